"""G3, worker side: which structured requests end in this step, read from
what the V1 runner already holds (no scheduler state, no grammar).

Fact this relies on (checked on xgrammar, guidance and outlines by
tests/v1/spec_decode/test_g3_draft_skip.py on vLLM 0.32 and 0.33): a grammar
terminates only when it accepts one of its stop tokens (xgrammar: the
request's `all_stop_token_ids`, i.e. EOS, generation-config EOS and user
stop ids; guidance / outlines: the tokenizer EOS, a subset of those). A
token sampled from a row the grammar filled (not an unconstrained all-ones
row: reasoning, an already terminated grammar) is a token the grammar
accepts there, so a stop token sampled from such a row terminates the
grammar, and patched G2 finishes the request at that token in the same
pass, with `ignore_eos` too. Without `ignore_eos`, or for a user stop id,
vLLM's own `check_stop` finishes it as well. Everything here errs towards
"not ending": a request that is not recognised keeps stock drafting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

_ALL_ONES = np.uint32(0xFFFFFFFF)


def request_rows(
    structured_output_request_ids: Sequence[str],
    grammar_bitmask: np.ndarray,
    scheduled_spec_decode_tokens: dict[str, Sequence[int]],
    num_spec_tokens: int,
) -> dict[str, np.ndarray]:
    """Per structured request, its bitmask rows for this step (drafts +
    bonus), as uint32 words. vLLM 0.33 gives each request `k + 1` rows;
    0.32 packs `1 + len(drafts)` rows cumulatively (the two agree when every
    request has k drafts, so the shape tells which layout it is)."""
    ids = list(structured_output_request_ids)
    words = np.ascontiguousarray(grammar_bitmask).view(np.uint32)
    strided = words.shape[0] == len(ids) * (num_spec_tokens + 1)
    rows: dict[str, np.ndarray] = {}
    offset = 0
    for i, req_id in enumerate(ids):
        n = 1 + len(scheduled_spec_decode_tokens.get(req_id, ()))
        start = i * (num_spec_tokens + 1) if strided else offset
        rows[req_id] = words[start:start + n]
        offset += n
    return rows


def _admits(row: np.ndarray, token: int) -> bool:
    word = token >> 5
    return 0 <= word < row.size and bool((int(row[word]) >> (token & 31)) & 1)


def _stop_only(row: np.ndarray, stops: Iterable[int]) -> bool:
    rest = row.copy()
    for t in stops:
        if 0 <= (t >> 5) < rest.size:
            rest[t >> 5] &= ~np.uint32(1 << (t & 31))
    return not rest.any()


def grammar_row(row: np.ndarray, stops: Iterable[int], stop_only: bool) -> bool:
    """Whether `row` was filled by the grammar (it constrains the token).
    All-ones rows are unconstrained. With `stop_only` (a reasoning parser is
    configured: vLLM 0.33 writes reasoning rows as all-ones minus a few
    reasoning-end ids, indistinguishable from a permissive grammar row) only
    a row that admits nothing but stop tokens counts."""
    if bool((row == _ALL_ONES).all()):
        return False
    return _stop_only(row, stops) if stop_only else True


def may_end(rows: np.ndarray, stops: frozenset[int], stop_only: bool) -> bool:
    """Cheap pre-check without the sampled tokens: can the request end in
    this step at all (some grammar row of it admits a stop token)?"""
    return bool(stops) and any(
        grammar_row(r, stops, stop_only) and any(_admits(r, t) for t in stops)
        for r in rows)


def ends_at(rows: np.ndarray, sampled: Sequence[int], stops: frozenset[int],
            stop_only: bool) -> int | None:
    """Index of the sampled token at which the request's grammar ends (a stop
    token sampled from a grammar row), or None. `sampled`: this step's
    tokens for the request (accepted drafts + bonus; -1 = rejected, ends)."""
    for j, t in enumerate(sampled):
        t = int(t)
        if t < 0 or j >= len(rows):
            return None
        if t in stops and grammar_row(rows[j], stops, stop_only) \
                and _admits(rows[j], t):
            return j
    return None


def stop_set(sampling_params: Any) -> frozenset[int]:
    """The stop tokens a request's grammar can end on, or an empty set when
    the worker cannot tell (no stop ids: xgrammar then uses the tokenizer's
    own stop tokens; min_tokens: stop tokens are masked for a while)."""
    if sampling_params is None or getattr(sampling_params, "min_tokens", 0):
        return frozenset()
    stops = set(getattr(sampling_params, "all_stop_token_ids", None) or ())
    eos = getattr(sampling_params, "eos_token_id", None)
    if eos is not None:
        stops.add(eos)
    return frozenset(int(t) for t in stops)


def withhold_drafts(out: Any, drop: Any) -> Any:
    """The runner's hand-over (`take_draft_token_ids`) with no drafts for the
    requests in `drop` (their grammar ended; shared by the V1 and V2 runner
    patches)."""
    if out is not None and drop:
        out.draft_token_ids = [
            [] if req_id in drop else list(ids)
            for req_id, ids in zip(out.req_ids, out.draft_token_ids)]
    return out


# --------------------------------------------------------------------------
# The grammar-end prediction both model runners use before drafting (V1:
# vllm_patch.v1.worker.gpu_model_runner.g3_drafts; V2:
# vllm_patch.v1.worker.gpu.model_runner). Each runner describes its batch in
# a BatchView; the decision and the record of ended requests are here.
# --------------------------------------------------------------------------

STATS_ATTR = "_vllm_patch_g3_draft_stats"
ENDED_ATTR = "_vllm_patch_g3_ended"      # req_id -> runner step it ended at
STEP_ATTR = "_vllm_patch_g3_step"        # the runner's sample_tokens count


def draft_stats(runner: Any) -> dict[str, int]:
    """Per-runner draft-skip counters (created on first use, so stock
    runners probed by the tests report zeros)."""
    stats = runner.__dict__.get(STATS_ATTR)
    if stats is None:
        stats = runner.__dict__[STATS_ATTR] = {
            # Calls into the runner's proposer (EAGLE / draft_model).
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
    """A worker's draft-skip counters (either model runner); for
    `LLM.collective_rpc(draft_skip_stats)` (runs in each worker process)."""
    return dict(draft_stats(getattr(worker, "model_runner", worker)))


def next_step(runner: Any) -> int:
    """Count one more sample_tokens of this runner; returns its number."""
    step = runner.__dict__[STEP_ATTR] = runner.__dict__.get(STEP_ATTR, 0) + 1
    return step


def g2_finishes_at_grammar_end() -> bool:
    """G2 finishes a request at its grammar's end in this process (the
    worker inherits the engine's environment and patch set): a vLLM build
    that carries G2 always does (the stop-on-termination switch does not
    reach its code), else the plugin's applied G2 unless switched off."""
    from vllm_patch import envs
    from vllm_patch.patching import REGISTRY, State, guarantee_native

    if guarantee_native("G2"):
        return True
    if not envs.settings().stop_on_grammar_termination:
        return False
    return any(o.state is State.APPLIED for n, o in REGISTRY.outcomes.items()
               if n.startswith("g2-commit-cut"))


def in_flight_depth(runner: Any) -> int:
    """Runner steps after a request's end in which it may still be in a
    batch (scheduled before the scheduler saw the end): async scheduling,
    the next step (pipeline parallel: the request's next step comes pp steps
    later, scheduled before the oldest is processed); sync with a pipeline's
    batch queue, up to pp - 1. Read from the scheduler config (Model Runner
    V2 has no use_async_scheduling attribute; the V1 runner copies it from
    there)."""
    sc = getattr(getattr(runner, "vllm_config", None), "scheduler_config", None)
    async_ = getattr(sc, "async_scheduling", None)
    if async_ is None:
        async_ = getattr(runner, "use_async_scheduling", False)
    pc = getattr(runner, "parallel_config", None)
    pp = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    return pp if async_ else pp - 1


@dataclass
class BatchView:
    """One runner step's batch as the prediction needs it, row i = request
    i of the sampled tokens. The callables are asked only as far as the
    decision needs them (most steps stop at the first request that goes
    on)."""

    req_ids: list[str]
    structured: Callable[[int], bool]
    # Row i commits a sampled token in this step (not a partial prefill).
    samples: Callable[[int], bool]
    stops: Callable[[int], frozenset[int]]
    # Drafts scheduled per request (for the bitmask row layout).
    spec_tokens: Mapping[str, Sequence[Any]]
    num_spec_tokens: int
    # This step's sampled tokens per row (accepted drafts + bonus; a device
    # to host copy: read only when every request may end).
    read_sampled: Callable[[], list[list[int]]]
    # Requests the runner still holds (others are forgotten); None: all.
    known: Any = None


def _live_ended(runner: Any, view: BatchView, depth: int) -> set[str]:
    """Requests of this batch whose grammar ended in an earlier step that is
    still allowed to be followed by an in-flight step (async scheduling:
    the next step was scheduled before the scheduler saw the end)."""
    ended: dict[str, int] = runner.__dict__.setdefault(ENDED_ATTR, {})
    step = runner.__dict__.get(STEP_ATTR, 0)
    batch = set(view.req_ids)
    live: set[str] = set()
    for req_id in list(ended):
        age = step - ended[req_id]
        gone = view.known is not None and req_id not in view.known
        if gone or age > depth:
            if req_id in batch and age > depth:
                draft_stats(runner)["mispredicted"] += 1
            del ended[req_id]
        elif req_id in batch and age > 0:
            live.add(req_id)
    return live


def predict_ends(runner: Any, view: BatchView, grammar_output: Any,
                 stop_only: bool) -> tuple[set[str], set[str], bool]:
    """(ended before this step, ending in it, every request of the batch is
    in one of the two).

    Ended before: a structured request the scheduler left out of this step's
    grammar output although it samples in this step: the scheduler no
    longer has it, i.e. it finished while this step was in flight (async
    scheduling; also aborts); or one whose grammar end this runner saw in an
    earlier step still in flight. Ending now: a grammar stop token sampled
    from a grammar row (needs G2's cut: only then does the end finish the
    request). The sampled tokens are read only when the answer can be
    "every request" from the bitmask alone."""
    batch = view.req_ids
    ended = _live_ended(runner, view, in_flight_depth(runner))
    in_grammar = set(grammar_output.structured_output_request_ids
                     if grammar_output is not None else ())
    for i, req_id in enumerate(batch):
        if req_id not in in_grammar and view.samples(i) and view.structured(i):
            ended.add(req_id)
    if len(ended) == len(batch):
        return ended, set(), True
    if grammar_output is None or not g2_finishes_at_grammar_end():
        return ended, set(), False
    rows = request_rows(grammar_output.structured_output_request_ids,
                        grammar_output.grammar_bitmask, view.spec_tokens,
                        view.num_spec_tokens)
    candidates: dict[int, tuple[str, frozenset[int]]] = {}
    for i, req_id in enumerate(batch):
        if req_id in ended:
            continue
        stops = view.stops(i)
        if (req_id not in rows or not view.samples(i)
                or not may_end(rows[req_id], stops, stop_only)):
            return ended, set(), False  # this one goes on: no skip
        candidates[i] = (req_id, stops)
    draft_stats(runner)["token_reads"] += 1
    sampled = view.read_sampled()
    ending = {req_id for i, (req_id, stops) in candidates.items()
              if ends_at(rows[req_id], sampled[i], stops, stop_only) is not None}
    step = runner.__dict__.get(STEP_ATTR, 0)
    log = runner.__dict__.setdefault(ENDED_ATTR, {})
    for req_id in ending:
        log[req_id] = step
    return ended, ending, len(ended) + len(ending) == len(batch)


def reasoning_rows(runner: Any) -> bool:
    """A reasoning parser is configured (grammar_row's stop_only)."""
    so = getattr(getattr(runner, "vllm_config", None),
                 "structured_outputs_config", None)
    return bool(getattr(so, "reasoning_parser", "") or "")
