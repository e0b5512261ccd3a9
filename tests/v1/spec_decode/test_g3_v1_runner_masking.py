"""G3 worker side: the V1 runner's draft masking (real tensors)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.scheduler


def test_positions_follow_batch_order_not_grammar_order():
    from vllm_patch.v1.worker.gpu_model_runner.g3_drafts import unacceptable_draft_positions

    # Batch: u (3 drafts, unstructured), t (3, limit 1), p (0: prefill),
    # n (2, limit 2); grammar order differs from batch order.
    pos = unacceptable_draft_positions(
        ["u", "t", "p", "n"], [3, 3, 0, 2], ["n", "t", "p"], [2, 1, 0])
    assert pos == [4, 5]


def test_mask_sets_minus_one_and_sampler_rejects():
    from vllm_patch.v1.worker.gpu_model_runner.g3_drafts import mask_unacceptable_drafts

    drafts = torch.tensor([7, 8, 9, 5, 6, 4], dtype=torch.int32)
    n = mask_unacceptable_drafts(drafts, ["a", "b"], [3, 3], ["b", "a"], [0, 2])
    assert n == 4
    assert drafts.tolist() == [7, 8, -1, -1, -1, -1]
    assert mask_unacceptable_drafts(drafts, ["a"], [3], ["a"], None) == 0


def test_v1_rejection_sampler_rejects_masked_draft():
    """vLLM's own V1 greedy rejection sampler (CPU kernels) on a draft the
    target agrees with: accepted as is, rejected once masked to -1. A
    changed `rejection_sample` API fails here; only a vLLM Python tree
    without its compiled extension (no kernel to run) is skipped."""
    import importlib.util
    from types import SimpleNamespace

    if importlib.util.find_spec("vllm._C") is None:
        pytest.skip("vLLM's compiled extension (vllm._C) is not installed: "
                    "no V1 rejection kernel to run")
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import rejection_sample

    from vllm_patch.v1.worker.gpu_model_runner.g3_drafts import mask_unacceptable_drafts

    current_platform.register_triton_kernel_overrides()
    vocab = 16
    logits = torch.full((3, vocab), -5.0)
    logits[0, 3] = logits[1, 1] = logits[2, 9] = 5.0   # target: 3, 1, 9
    meta = SimpleNamespace(all_greedy=True, all_random=False, generators={})

    def sample(draft):
        out = rejection_sample(draft, [3], 3, torch.tensor([3], dtype=torch.int32),
                               None, logits.clone(),
                               torch.tensor([[2]], dtype=torch.int64).view(-1),
                               meta)
        return [t for t in out[0].tolist() if t >= 0]

    drafts = torch.tensor([3, 1, 9], dtype=torch.int32)
    assert sample(drafts.clone()) == [3, 1, 9, 2]
    mask_unacceptable_drafts(drafts, ["r"], [3], ["r"], [2])
    assert sample(drafts) == [3, 1, 9]  # position 2 rejected: target's token
