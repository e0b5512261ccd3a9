"""Smoke test of the grammar-aware drafting cost benchmark
(benchmarks/grammar_draft_cost.py --quick --floor): it runs, its JSON has the
shape the docs' tables are made from, and stock's own verification grammar
work is measured (nonzero) in the same run as the drafting modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
MODES = {"stock", "off", "default", "always"}


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
    out = tmp_path / "cost.json"
    env = dict(os.environ)
    env.pop("VLLM_PATCH_DISABLE", None)  # the benchmark runs every mode itself
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "grammar_draft_cost.py"),
         "--quick", "--floor", "--json", str(out)],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not a GPU measurement" in proc.stdout
    data = json.loads(out.read_text())
    assert data["cells"], data.get("skipped")
    for cell in data["cells"]:
        assert {"vocab", "vocab_size", "backend", "k", "batch", "modes",
                "projection"} <= set(cell)
        assert set(cell["modes"]) == MODES
        stock, always = cell["modes"]["stock"], cell["modes"]["always"]
        # Stock's verification work (drafts trimmed, k+1 bitmask rows per
        # request, accept) is measured in the same run.
        assert stock["verify_ms"] > 0
        assert stock["grammar_cpu_ms"] >= stock["verify_ms"]
        # Grammar-aware drafting ran (always on): the walk read the device.
        assert always["d2h_syncs"] >= 1 and always["shadows"] >= 1
        for gpu in ("10ms", "20ms", "30ms"):
            per = cell["projection"][gpu]
            assert set(per) >= {"perfect", "eagle", "draft"}
            assert per["eagle"]["stock"] == 1.0
        # Verification work is counted in bitmask rows as well as timed: the
        # off lane drafts as stock does, so it fills the same rows, and the
        # projection (rows priced at stock's rate) puts it at stock's rate
        # but for its hooks' own time; the raw timings are kept apart.
        off = cell["modes"]["off"]
        assert off["verify_rows"] == stock["verify_rows"] > 0
        assert always["verify_rows"] >= stock["verify_rows"]
        assert 0.97 <= cell["projection"]["20ms"]["eagle"]["off"] <= 1.0
        assert set(cell["projection"]["measured_20ms"]) >= {"eagle", "sim"}
        # --floor: the library's own calls inside the always-on lane's
        # drafting (xgrammar's batched accepts at B > 1), a part of its time.
        floor = cell["floor"]
        assert floor["steps"] == data["args"]["reps"]
        if cell["batch"] > 1:
            assert floor["calls"]["xgrammar batch_accept_token"]["items"] > 0
        assert 0 < floor["library_ms"] <= always["draft_ms"]
    assert "Library calls inside the always-on lane's drafting" in proc.stdout
