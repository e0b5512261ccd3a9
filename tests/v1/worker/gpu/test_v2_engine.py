"""G2 / G3 end to end on Model Runner V2: a real vLLM engine on the CPU
running V2 (`VLLM_USE_V2_MODEL_RUNNER=1`) through Triton's interpreter
(`TRITON_INTERPRET=1`), as `scripts/validate_gpu.py --cpu-interpreter` does:
each configuration runs in its own subprocess (the interpreter set-up must
come before vLLM is imported; the script's `run_config` does it), the tiny
local model with `draft_model` (itself as draft, greedy: drafts accepted
~100 %, so multi-token steps cross the grammar's end) or the tiny trained
EAGLE head, k = 4, JSON schema / choice / regex requests with and without
ignore_eos, async scheduling on (the test-only switch) and off.

Patched: every structured output valid, no token after the grammar's end,
finish "stop" only, accepted <= drafted, V2's draft-skip counters show
the speculator skipped or its drafts withheld after a grammar's end, and
grammar-aware drafting (on by default) drafted under the grammars through
xgrammar's batched matcher calls (results read in one call each).
Stock (VLLM_PATCH_DISABLE=1): every ignore_eos request runs on past its
grammar's end (the failure G2 removes); the others are right (control).

Minutes per configuration (the interpreter runs every Triton kernel in
numpy): marker `v2` only, outside scripts/test.sh's tiers.

    python -m pytest tests/v1/worker/gpu/test_v2_engine.py -m v2 -q -s
    VLLM_PATCH_DISABLE=1 python -m pytest tests/v1/worker/gpu/test_v2_engine.py -m v2 -q -s
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.v2

SCRIPT = Path(__file__).resolve().parents[4] / "scripts" / "validate_gpu.py"
K = 4
TIMEOUT = 1500


def _script():
    spec = importlib.util.spec_from_file_location("validate_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("method,async_", [
    ("draft_model", True), ("draft_model", False), ("eagle", True)],
    ids=["draft_model-async", "draft_model-sync", "eagle-async"])
def test_v2_engine(method, async_, patched):
    mod = _script()
    cfg = {"runner": "V2", "async": async_, "method": method, "pp": 1,
           "mode": "patched" if patched else "stock", "k": K, "model": None,
           "draft_model": None, "eagle_model": None, "cpu_interpreter": True}
    res = mod.run_config(cfg, TIMEOUT)
    print("\nV2-E2E " + mod.row_text(cfg, res))
    assert "error" not in res and "refused" not in res, res
    # The engine really ran Model Runner V2.
    assert res["runner_module"] in ("vllm.v1.worker.cpu.model_runner",
                                    "vllm.v1.worker.gpu.model_runner"), res
    counts, spec, problems = res["counts"], res["spec"], res["problems"]
    finish = {k[7:]: v for k, v in counts.items() if k.startswith("finish_")}
    assert spec["accepted"] <= spec["draft_tokens"], spec
    assert spec["draft_tokens"] > 0, spec
    ignoring = counts["requests"] // 2  # half the requests set ignore_eos
    if not patched:
        # Every ignore_eos request runs on past its grammar's end (G2).
        assert len(problems) == ignoring, problems
        assert all("token(s) after the grammar's end" in p for p in problems), problems
        assert counts.get("post_grammar_tokens", 0) > 0
        assert not res["draft_skip"], res["draft_skip"]
        return
    assert problems == [], problems
    assert counts.get("valid", 0) == counts["requests"]
    assert counts.get("post_grammar_tokens", 0) == 0
    assert set(finish) == {"stop"}, finish
    # G3 on V2: the speculator saw requests whose grammar ends; it was
    # skipped or their drafts withheld.
    skip = res["draft_skip"]
    assert skip.get("proposer_calls", 0) > 0, skip
    assert skip.get("skipped_request_drafts", 0) + \
        skip.get("dropped_request_drafts", 0) > 0, skip
    # Grammar-aware drafting ran, through the batched xgrammar path.
    g = res["grammar_drafts"]
    assert g.get("active") == 1 and g.get("positions", 0) > 0, g
    assert g.get("xgr_batch_accept_calls", 0) > 0, g
    assert g.get("xgr_flags_slow") == 0, g
