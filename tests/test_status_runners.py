"""`vllm-patch status` per model runner (V1 / V2), in this process, on the
vLLM of this run (scripts/test.sh runs the unit tier on 0.32 and 0.33).

Facts checked against vLLM's tree: the V1 runner is
vllm/v1/worker/gpu_model_runner.py, Model Runner V2 is vllm/v1/worker/gpu/;
V2 rejects drafts past num_acceptable_drafts itself
(gpu/structured_outputs.py::grammar_invalid_drafts, on 0.32 and 0.33)."""

from __future__ import annotations

import types

import pytest

from vllm_patch import patching
from vllm_patch.patching import REGISTRY, State

pytestmark = pytest.mark.unit

STATUSES = ("native", "patched", "partial", "not enforced")
# Keys of a guarantee row before the per-runner view: kept as they were.
ROW_KEYS = {"guarantee", "text", "status", "reason", "implementation",
            "limits", "patches"}


def test_rows_keep_their_keys_and_add_runners(patched):
    rows = patching.guarantee_table()
    for row in rows:
        assert ROW_KEYS <= set(row)
        assert set(row["runners"]) == {"V1", "V2"}
        for runner in row["runners"].values():
            assert runner["status"] in STATUSES
            if not patched:
                assert runner["status"] == "not enforced"
                assert runner["patches_applied"] == []
    g3 = {r["guarantee"]: r for r in rows}["G3"]
    if patched:
        assert g3["runners"]["V1"]["status"] == g3["status"]
        # V1's worker-side patch counts for V1 only.
        assert "g3-v1-runner-acceptable-drafts" in \
            g3["runners"]["V1"]["patches_applied"]
        assert "g3-v1-runner-acceptable-drafts" not in \
            g3["runners"]["V2"]["patches_applied"]
        assert "grammar_invalid_drafts" in g3["runners"]["V2"]["native"]


def test_patch_runners_by_target():
    by_name = REGISTRY.patches
    assert patching.patch_runners(by_name["g3-v1-runner-acceptable-drafts"]) == ("V1",)
    assert patching.patch_runners(by_name["g1-gate-schedule"]) == ("V1", "V2")
    fake = types.SimpleNamespace(target="vllm.v1.worker.gpu.spec_decode.utils:X.y")
    assert patching.patch_runners(fake) == ("V2",)


def test_v1_only_patch_missing_leaves_v2_patched(monkeypatch):
    """A V1 worker patch that is not applied makes G3 partial on V1 only:
    V2 does that check natively."""
    name = "g3-v1-runner-acceptable-drafts"
    patch = REGISTRY.patches[name]
    row = {"guarantee": "G3", "status": "partial",
           "reason": f"{name}: {State.SKIPPED_BY_USER.value}",
           "patches": [{"name": name, "state": State.SKIPPED_BY_USER.value}]}
    assert patch.required
    out = patching.runner_rows(row)
    assert out["V1"]["status"] == "partial"
    assert out["V2"]["status"] == "patched"
    assert out["V2"]["reason"] == ""


@pytest.mark.parametrize("value,runner", [("0", "V1"), ("1", "V2")])
def test_selected_runner_from_environment(monkeypatch, value, runner):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
    chosen = patching.selected_runner()
    assert chosen["runner"] == runner
    assert "VLLM_USE_V2_MODEL_RUNNER" in chosen["decided_by"]


def test_selected_runner_without_triton_or_from_config(monkeypatch):
    from vllm.triton_utils import HAS_TRITON

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    chosen = patching.selected_runner()
    # The CPU build here has no usable Triton: V1; with Triton, the config.
    assert chosen["runner"] == (None if HAS_TRITON else "V1")
    config = types.SimpleNamespace(use_v2_model_runner=True)
    assert patching.selected_runner(config)["runner"] == "V2"
