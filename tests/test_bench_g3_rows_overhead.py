"""Smoke test of benchmarks/g3_rows_overhead.py (the per-row cost of G3's
row patch over vLLM's `_fill_bitmasks`): it runs a short interleaved
measurement, with an older wrapper loaded from a file (here this
checkout's own module), and reports every mode."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.patched_only]

REPO = Path(__file__).resolve().parents[1]


def test_short_run():
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "g3_rows_overhead.py"),
         "--reps", "3", "--batch", "16", "--old-source",
         str(REPO / "vllm_patch" / "v1" / "structured_output" / "g3_rows.py")],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    modes = [ln.split()[0] for ln in proc.stdout.splitlines()
             if "us/row" in ln]
    assert modes == ["vllm", "wrapper", "old"], proc.stdout
