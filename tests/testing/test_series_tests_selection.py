"""Which of vLLM's tests the series tier runs for a patch
(`series_env.series_tests`): a test file the patch creates, whole; in a file
it changes, the tests its hunks add or change (also one whose `def` line is
only in a hunk's context, where git's @@ header names the function before
it); the whole file when a hunk changes lines outside any test."""

from __future__ import annotations

import pytest

from vllm_patch import series
from vllm_patch.testing import series_env

pytestmark = pytest.mark.unit

HEAD = """From 0000 Mon Sep 17 00:00:00 2001
From: vllm-patch <vllm-patch@example.invalid>
Subject: [PATCH] x

---
"""


def _diff(path: str, hunks: list[str], new: bool = False) -> str:
    out = f"diff --git a/{path} b/{path}\n"
    if new:
        out += "new file mode 100644\n"
    out += f"--- a/{path}\n+++ b/{path}\n"
    return out + "".join(hunks)


def _select(tmp_path, monkeypatch, *diffs: str) -> list[str]:
    d = tmp_path / "vllm-9.9.9"
    d.mkdir()
    (d / "0001-x.patch").write_text(HEAD + "".join(diffs) + "-- \n2.39.5\n")
    monkeypatch.setattr(series, "PATCHES_DIR", tmp_path)
    return series_env.series_tests("9.9.9")


def test_new_file_whole(tmp_path, monkeypatch):
    got = _select(tmp_path, monkeypatch, _diff(
        "tests/v1/test_new.py", ["@@ -0,0 +1,2 @@\n+def test_a():\n+    pass\n"],
        new=True))
    assert got == ["tests/v1/test_new.py"]


def test_change_inside_a_test_whose_def_is_in_the_context(tmp_path, monkeypatch):
    # The header names the function before the changed test.
    hunk = ("@@ -10,6 +10,7 @@ def test_before():\n"
            " \n"
            " def test_changed():\n"
            "     runner = object()\n"
            "+    runner.flag = False\n"
            "     assert runner\n")
    got = _select(tmp_path, monkeypatch, _diff("tests/v1/test_x.py", [hunk]))
    assert got == ["tests/v1/test_x.py::test_before",
                   "tests/v1/test_x.py::test_changed"]


def test_added_test_with_its_helper(tmp_path, monkeypatch):
    hunk = ("@@ -10,6 +10,12 @@ def test_before():\n"
            "     pass\n"
            "+def _helper():\n"
            "+    return 1\n"
            "+\n"
            "+def test_added():\n"
            "+    assert _helper()\n")
    got = _select(tmp_path, monkeypatch, _diff("tests/v1/test_x.py", [hunk]))
    assert got == ["tests/v1/test_x.py::test_added",
                   "tests/v1/test_x.py::test_before"]


def test_change_outside_any_test_runs_the_whole_file(tmp_path, monkeypatch):
    hunk = ("@@ -1,3 +1,4 @@\n"
            " import os\n"
            "+import sys\n"
            " \n")
    got = _select(tmp_path, monkeypatch, _diff("tests/v1/test_x.py", [hunk]))
    assert got == ["tests/v1/test_x.py"]


def test_change_inside_the_first_test_of_a_file(tmp_path, monkeypatch):
    # No function before it: the header names none, the context holds the def.
    hunk = ("@@ -1,4 +1,5 @@\n"
            " def test_first():\n"
            "     x = 1\n"
            "+    x += 1\n"
            "     assert x\n")
    got = _select(tmp_path, monkeypatch, _diff("tests/v1/test_x.py", [hunk]))
    assert got == ["tests/v1/test_x.py::test_first"]
