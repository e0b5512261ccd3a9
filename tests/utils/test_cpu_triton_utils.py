"""vLLM's CPU stand-in for the rejection sampler's `expand_kernel`
(vllm.utils.cpu_triton_utils._expand_kernel_impl) must write into the
caller's output whatever its dtype. Stock converts the output with
`.to(torch.int64)` and writes into the discarded copy: a float or int32
output keeps whatever it held (uninitialised memory in
`expand_batch_to_tokens`), so the temperatures / top-k / top-p of every
non-greedy speculative-decoding batch are garbage on the CPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit

FILL = 12345


def _expand(output, x, cu, replace_from=0, replace_to=0):
    """The function `expand_batch_to_tokens` calls, through vLLM's kernel
    dispatcher with the CPU platform's overrides registered."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample import rejection_sampler as rs

    if HAS_TRITON:
        pytest.skip("Triton present: the CPU overrides are not used")
    CpuPlatform.register_triton_kernel_overrides()
    rs._expand(output, x, cu, replace_from, replace_to)
    return output


def _has_cpu_op() -> bool:
    """The C++ op stock calls (a CPU build of vLLM; the 0.33 tree used here
    is the Python source without compiled ops)."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()  # as vLLM loads its CPU ops
    return hasattr(torch.ops._C, "expand_kernel_impl")


CASES = {
    # temperatures of a mixed batch: greedy (0) -> 1, as the sampler asks
    "float32-temperature": (torch.float32, [0.8, 0.0, 0.5], 0, 1,
                            [0.8, 0.8, 1.0, 1.0, 1.0, 0.5]),
    "float32-top_p": (torch.float32, [0.9, 1.0, 0.3], 0, 0,
                      [0.9, 0.9, 1.0, 1.0, 1.0, 0.3]),
    "int32-top_k": (torch.int32, [5, 400, 2], 0, 0, [5, 5, 400, 400, 400, 2]),
    "int64": (torch.int64, [5, 7, 2], 7, 9, [5, 5, 9, 9, 9, 2]),
}


@pytest.mark.parametrize("case", CASES)
def test_expand_writes_into_the_output(case, patched):
    dtype, x, rf, rt, want = CASES[case]
    if (not patched or dtype == torch.int64) and not _has_cpu_op():
        pytest.skip("stock's C++ expand op is not built in this vLLM")
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = _expand(torch.full((6,), FILL, dtype=dtype),
                  torch.tensor(x, dtype=dtype), cu, rf, rt)
    expected = torch.tensor(want, dtype=dtype)
    if patched or dtype == torch.int64:
        assert torch.equal(out, expected), out
    else:
        # Stock: nothing written, the buffer keeps what it held.
        assert torch.equal(out, torch.full((6,), FILL, dtype=dtype)), out


def test_expand_batch_to_tokens_temperatures(patched):
    """The rejection sampler's own call: a mixed greedy / temperature-0.8
    batch, 3 drafts + 1 token each."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    if not patched:
        pytest.skip("stock returns uninitialised memory (nothing to pin; "
                    "the pre-filled buffer above shows stock's failure)")
    _expand(torch.empty(1), torch.zeros(1), torch.ones(1, dtype=torch.int32))
    temp = torch.tensor([0.0, 0.8, 0.8, 0.0])
    cu = torch.tensor([4, 8, 12, 16], dtype=torch.int32)
    want = torch.tensor([1.0] * 4 + [0.8] * 8 + [1.0] * 4)
    got = expand_batch_to_tokens(temp, cu, 16, replace_from=0, replace_to=1)
    assert torch.equal(got, want)
