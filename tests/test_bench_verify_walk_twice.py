"""Smoke test of benchmarks/verify_walk_twice.py: it runs on the cost
benchmark's world, and the second walk wrote the same rows (it raises if
not)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_patch.testing.jsonschemabench import MASKBENCH, MISSING

pytestmark = [pytest.mark.unit, pytest.mark.patched_only]

REPO = Path(__file__).resolve().parents[1]


def test_small_run():
    if not MASKBENCH.is_dir():
        pytest.skip(MISSING)
    env = dict(os.environ)
    env.pop("VLLM_PATCH_DISABLE", None)
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "verify_walk_twice.py"), "--vocabs", "32k",
         "--backends", "xgrammar", "--k", "2", "--batch", "8", "--reps", "2", "--warmup", "2",
         "--schemas", "8", "--profile"],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "again right after" in proc.stdout and "rows identical" in proc.stdout
    assert "function calls" in proc.stdout  # the profile of one walk
