"""Fix for vllm.utils.cpu_triton_utils: the CPU stand-in for the rejection
sampler's `expand_kernel` writes nothing into a float or int32 output
(production fix, on by default; not a G1-G4 guarantee).

Without Triton, vLLM's CPU platform replaces the rejection sampler's Triton
kernels with C++ ops (`CpuPlatform.register_triton_kernel_overrides`).
`_expand_kernel_impl` passes its `output` through `_ensure_int64`, i.e.
`.to(torch.int64)`: for any output that is not int64 the C++ op writes into a
temporary copy that is thrown away, and (for a float input) it reads the
values truncated to integers. `expand_batch_to_tokens` allocates its output
with `new_empty` and returns it as is: uninitialised memory. In every
speculative-decoding step whose batch is not all greedy, the rejection sampler
divides the target logits at the draft positions by those garbage
"temperatures" (float32) and applies garbage top-k (int32) / top-p (float32)
to them, so the acceptance of drafts and the recovered tokens are decided on
nonsense probabilities: NaN/inf logits, tokens a grammar never allowed.

The replacement expands with torch ops into the caller's own output (any
dtype; `replace_from` -> `replace_to` as the Triton kernel does), and keeps
the C++ op for the int64 case it handles correctly. vLLM reads the module
attribute when a worker registers its overrides, right after loading
plugins, so the fixed function is the one registered.
"""

from __future__ import annotations

from typing import Any, Callable

from vllm_patch.patching import Patch


def _make_expand(original: Callable[..., Any]) -> Callable[..., Any]:
    def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from,
                            replace_to, MAX_NUM_TOKENS=None):
        import torch

        if output.dtype == torch.int64 and input_val.dtype == torch.int64:
            # Stock writes in place here (no copy is made): keep it.
            return original(output, input_val, cu_num_tokens, replace_from,
                            replace_to, MAX_NUM_TOKENS)
        n = input_val.shape[0]
        if n == 0:
            return None
        cu = cu_num_tokens[:n].to(torch.int64)
        starts = torch.cat([cu.new_zeros(1), cu[:-1]])
        counts = cu - starts
        vals = torch.where(input_val == replace_from,
                           torch.tensor(replace_to, dtype=input_val.dtype),
                           input_val).to(output.dtype)
        if MAX_NUM_TOKENS is None or int(counts.max()) <= MAX_NUM_TOKENS:
            expanded = torch.repeat_interleave(vals, counts)
            output[:expanded.numel()].copy_(expanded)
            return None
        # As the kernel: at most MAX_NUM_TOKENS values per request.
        for i in range(n):
            s, k = int(starts[i]), min(int(counts[i]), MAX_NUM_TOKENS)
            output[s:s + k] = vals[i]
        return None

    return _expand_kernel_impl


PATCHES: list[Patch] = [
    Patch(
        name="cpu-spec-expand-fix",
        guarantee="package",
        target="vllm.utils.cpu_triton_utils:_expand_kernel_impl",
        versions=("0.32", "0.33"),
        signature=("output", "input_val", "cu_num_tokens", "replace_from",
                   "replace_to", "MAX_NUM_TOKENS"),
        make=_make_expand,
        why=("on the CPU (no Triton) the rejection sampler's expand kernel "
             "converts its output with .to(torch.int64), so for float/int32 "
             "outputs it writes into a discarded copy: in every speculative-"
             "decoding batch that is not all greedy, target logits at draft "
             "positions are divided by uninitialised 'temperatures' (and get "
             "garbage top-k/top-p), so draft acceptance and recovered tokens "
             "come from NaN/garbage probabilities"),
        how=("replaces the CPU stand-in with a torch expansion into the "
             "caller's output (any dtype, replace_from -> replace_to as the "
             "Triton kernel); the C++ op still runs for all-int64 tensors"),
        upstream="none yet (vLLM vllm/utils/cpu_triton_utils.py "
                 "_expand_kernel_impl)",
        remove_when="vLLM's CPU expand kernel writes into non-int64 outputs",
    ),
]
