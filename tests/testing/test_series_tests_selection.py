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


@pytest.mark.parametrize(("hunk", "want"), [
    # A change inside a test whose def is in the context; the header names
    # the function before it.
    ("@@ -10,6 +10,7 @@ def test_before():\n"
     " \n"
     " def test_changed():\n"
     "     runner = object()\n"
     "+    runner.flag = False\n"
     "     assert runner\n",
     ["::test_before", "::test_changed"]),
    # A test added with its helper.
    ("@@ -10,6 +10,12 @@ def test_before():\n"
     "     pass\n"
     "+def _helper():\n"
     "+    return 1\n"
     "+\n"
     "+def test_added():\n"
     "+    assert _helper()\n",
     ["::test_added", "::test_before"]),
    # A change outside any test: the whole file.
    ("@@ -1,3 +1,4 @@\n"
     " import os\n"
     "+import sys\n"
     " \n",
     [""]),
    # A change inside the first test of a file: no function before it, the
    # header names none, the context holds the def.
    ("@@ -1,4 +1,5 @@\n"
     " def test_first():\n"
     "     x = 1\n"
     "+    x += 1\n"
     "     assert x\n",
     ["::test_first"]),
], ids=["context-def", "added-with-helper", "outside-tests", "first-test"])
def test_changed_file_runs_the_tests_its_hunks_touch(tmp_path, monkeypatch,
                                                      hunk, want):
    got = _select(tmp_path, monkeypatch, _diff("tests/v1/test_x.py", [hunk]))
    assert got == [f"tests/v1/test_x.py{w}" for w in want]
