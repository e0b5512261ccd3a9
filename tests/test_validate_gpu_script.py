"""scripts/validate_gpu.py (the GPU validation an operator runs with CUDA
vLLM): it parses its arguments, plans the runs it promises, and without a
GPU (this machine) it runs nothing and says why. Cheap: no vLLM engine."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "validate_gpu.py"


def _module():
    spec = importlib.util.spec_from_file_location("validate_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plans_every_configuration():
    mod = _module()
    args = mod.parse_args([])
    one = mod.configs(args, gpus=1)
    # V1/V2 x async on/off x EAGLE/draft_model x stock/patched, PP=1.
    assert len(one) == 16
    assert {(c["runner"], c["async"], c["method"], c["mode"]) for c in one} == {
        (r, a, m, s) for r in ("V1", "V2") for a in (True, False)
        for m in ("eagle", "draft_model") for s in ("stock", "patched")}
    two = mod.configs(args, gpus=2)
    assert {c["pp"] for c in two} == {1, 2} and len(two) == 32
    picked = mod.configs(mod.parse_args(["--runner", "V2", "--async-scheduling",
                                         "on", "--pp", "1"]), gpus=2)
    assert {(c["runner"], c["async"], c["pp"]) for c in picked} == {("V2", True, 1)}


def test_row_and_verdict():
    mod = _module()
    cfg = mod.configs(mod.parse_args(["--runner", "V2", "--method", "eagle"]), 1)[0]
    good = {"counts": {"valid": 24, "requests": 24, "post_grammar_tokens": 0,
                       "finish_stop": 24}, "spec": {"accepted": 3, "draft_tokens": 9},
            "problems": [], "seconds": 1.0}
    assert mod.clean(good)
    assert "valid 24/24" in mod.row_text(cfg, good)
    assert not mod.clean({**good, "spec": {"accepted": 10, "draft_tokens": 9}})
    assert mod.clean({"refused": "ValueError: no"})
    assert not mod.clean({"error": "exit 1"})


def test_without_gpu_fails_clearly():
    bad = subprocess.run([sys.executable, str(SCRIPT), "--bogus"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unrecognized arguments" in bad.stderr
    if _module().gpu_count():
        pytest.skip("a GPU is visible: the script would run")
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    assert "no CUDA GPU is visible" in out.stderr
