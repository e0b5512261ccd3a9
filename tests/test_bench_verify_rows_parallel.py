"""Smoke test of benchmarks/verify_rows_parallel.py --quick: it runs, every
mode's bitmask equals stock's row for row (the benchmark exits 1 if not),
and its JSON has the shape the docs' table is made from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.patched_only]

REPO = Path(__file__).resolve().parents[1]


def test_quick_run(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import grammar_draft_cost as bench
    finally:
        sys.path.pop(0)
    try:
        bench.maskbench()
    except LookupError as exc:
        pytest.skip(str(exc))
    out = tmp_path / "verify.json"
    env = dict(os.environ)
    env.pop("VLLM_PATCH_DISABLE", None)  # the benchmark runs every mode itself
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "verify_rows_parallel.py"),
         "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Amdahl" in proc.stdout  # the modelled column says it is a model
    cells = json.loads(out.read_text())["cells"]
    assert cells
    for c in cells:
        assert c["identical"]
        assert set(c["wall_ms"]) == {"stock", "serial", "threads", "parallel"}
        assert set(c["step_ratio"]) == {"10ms", "20ms", "30ms"}
        assert c["rows"] >= c["batch"]
