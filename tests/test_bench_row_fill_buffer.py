"""Smoke test of benchmarks/row_fill_buffer.py: it runs on real MaskBench
grammars, both ways write the same rows (it exits 1 if not), and its JSON
has the per-row figures the docs quote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_patch.testing.jsonschemabench import MASKBENCH, MISSING

pytestmark = [pytest.mark.unit, pytest.mark.patched_only]

REPO = Path(__file__).resolve().parents[1]


def test_small_run(tmp_path):
    if not MASKBENCH.is_dir():
        pytest.skip(MISSING)
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "row_fill_buffer.py"), "--vocab", "32k",
         "--batch", "8", "--k", "3", "--reps", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rows identical" in proc.stdout
    data = json.loads(out.read_text())
    assert data["rows"] == 8 * 4
    assert data["us_per_row"]["batch"] > 0 and data["us_per_row"]["buffer"] > 0
    bad = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "row_fill_buffer.py"), "--batch", "0"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert bad.returncode == 2 and "at least 1" in bad.stderr
