"""G3 for vllm.v1.worker.gpu.model_runner (Model Runner V2): no drafts for
requests whose grammar ends.

V2 already rejects drafts past the scheduler's `num_acceptable_drafts`
(`grammar_invalid_drafts`), so G3's acceptance guarantee holds there with
the scheduler-side rows alone. What V2 still does after a grammar's end: its
speculator proposes drafts (k forward passes of EAGLE / draft_model) for
requests that end in this step or ended in the previous one under async
scheduling, and hands them to the scheduler (`take_draft_token_ids`).

The same prediction as the V1 runner's draft skip (one implementation:
`vllm_patch.v1.spec_decode.grammar_end.predict_ends`): a request ends when a grammar
stop token is sampled from a grammar-filled bitmask row (patched G2 then
finishes it), or it ended before (a structured request the scheduler left out
of this step's grammar output: it finished while the step was in flight).

Where (V2's `sample_tokens`, pinned: sample(), postprocess_sampled, then
`self.speculator.propose(input_batch, ...)` in one call): `sample` keeps the
step's sampled tokens, and for the duration of `sample_tokens` the
speculator's `propose` goes through the decision (an instance attribute on
the speculator, removed after the step; its class is untouched). When every
request of the batch ends, the speculator is not run for this step:
`propose` answers zero drafts (as the V1 runner's "does not fit in the
drafter" path), which V2 stores and does not hand over (withheld); the
scheduler schedules none for finished requests. When only some end, the speculator runs as in stock and
those requests hand the scheduler no drafts. Counters as on V1
(`vllm_patch.v1.spec_decode.grammar_end.draft_skip_stats` reads both).
Pipeline parallel and data parallel: the speculator is never skipped
(other ranks run it in step); drafts are still withheld.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_patch.audited import pin
from vllm_patch.patching import Patch
from vllm_patch.v1.spec_decode import grammar_end
from vllm_patch.v1.spec_decode.grammar_end import STATS_ATTR, draft_stats

logger = logging.getLogger(__name__)

_GRAMMAR_ATTR = "_vllm_patch_v2_grammar_output"
_DROP_ATTR = "_vllm_patch_v2_drop"       # req_ids: hand over no drafts
_SAMPLED_ATTR = "_vllm_patch_v2_sampled"  # (input batch, tokens, counts)
_STOPS_ATTR = "_vllm_patch_v2_stops"     # req_id -> (structured, stop set)

__all__ = ["STATS_ATTR", "ending_requests"]


def _ctx(runner: Any) -> dict:
    return runner.__dict__


def _make_add_requests(original: Any) -> Any:
    def add_requests(self: Any, scheduler_output: Any) -> Any:
        stops = _ctx(self).setdefault(_STOPS_ATTR, {})
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            params = getattr(new, "sampling_params", None)
            stops[new.req_id] = (
                getattr(params, "structured_outputs", None) is not None,
                grammar_end.stop_set(params))
        for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
            stops.pop(req_id, None)
        return original(self, scheduler_output)

    return add_requests


def _make_sample_tokens(original: Any) -> Any:
    def sample_tokens(self: Any, grammar_output: Any) -> Any:
        d = _ctx(self)
        grammar_end.next_step(self)
        d[_GRAMMAR_ATTR] = grammar_output
        d[_DROP_ATTR] = frozenset()
        d.pop(_SAMPLED_ATTR, None)
        speculator = getattr(self, "speculator", None)
        own = getattr(speculator, "__dict__", None)
        if own is not None:
            # For this step only: the speculator's own propose, through the
            # decision below (an instance attribute shadows the class method;
            # isinstance checks in sample_tokens still see the real class).
            own["propose"] = _propose_for(self, speculator)
        try:
            return original(self, grammar_output)
        finally:
            d[_GRAMMAR_ATTR] = None
            d.pop(_SAMPLED_ATTR, None)
            if own is not None:
                own.pop("propose", None)

    return sample_tokens


def _propose_for(runner: Any, speculator: Any) -> Any:
    real = type(speculator).propose.__get__(speculator)

    def propose(input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        d = _ctx(runner)
        sampled = d.get(_SAMPLED_ATTR)
        if sampled is None or sampled[0] is not input_batch:
            return real(input_batch, *args, **kwargs)
        stats = draft_stats(runner)
        stats["proposer_calls"] += 1
        before, ending, all_end = ending_requests(
            runner, input_batch, d.get(_GRAMMAR_ATTR), sampled[1], sampled[2])
        d[_DROP_ATTR] = frozenset(before | ending)
        if all_end and _skippable(runner):
            stats["skipped_calls"] += 1
            stats["skipped_request_drafts"] += len(before) + len(ending)
            return _no_drafts(runner, input_batch)
        stats["dropped_request_drafts"] += len(before) + len(ending)
        return real(input_batch, *args, **kwargs)

    return propose


def ending_requests(runner: Any, input_batch: Any, grammar_output: Any,
                    sampled_tokens: Any, num_sampled: Any,
                    ) -> tuple[set[str], set[str], bool]:
    """grammar_end.predict_ends for V2's InputBatch and sampler output: a
    row samples when it has sampled tokens in this step (not a partial
    prefill); V2 keeps no sampling parameters, so the stop tokens come
    from add_requests."""
    batch = list(input_batch.req_ids)
    if not batch or not getattr(input_batch, "has_structured_output_reqs", True):
        return set(), set(), False
    stops: dict = _ctx(runner).get(_STOPS_ATTR, {})
    n_sampled = [int(n) for n in (num_sampled.tolist()
                                  if hasattr(num_sampled, "tolist") else num_sampled)]
    per_req = getattr(input_batch, "num_draft_tokens_per_req", None)

    def read_sampled() -> list[list[int]]:
        rows = sampled_tokens.tolist() if hasattr(sampled_tokens, "tolist") \
            else [list(r) for r in sampled_tokens]
        return [row[:n] for row, n in zip(rows, n_sampled)]

    view = grammar_end.BatchView(
        req_ids=batch,
        structured=lambda i: stops.get(batch[i], (False, frozenset()))[0],
        samples=lambda i: n_sampled[i] > 0,
        stops=lambda i: stops.get(batch[i], (False, frozenset()))[1],
        spec_tokens={req_id: [0] * (int(per_req[i]) if per_req is not None else 0)
                     for i, req_id in enumerate(batch)},
        num_spec_tokens=int(getattr(runner, "num_speculative_steps", 0) or 0),
        read_sampled=read_sampled)
    return grammar_end.predict_ends(runner, view, grammar_output,
                                    grammar_end.reasoning_rows(runner))


def _no_drafts(runner: Any, input_batch: Any) -> Any:
    """Drafts that are never used, for every request of the batch, without
    running the draft model: zeros, as the V1 runner's own "does not fit in
    the drafter" path. Not -1: under async scheduling V2 feeds its stored
    drafts to the in-flight next step as input ids (the scheduler gave
    those requests num_acceptable_drafts = 0, so they are rejected)."""
    import torch

    k = int(getattr(runner, "num_speculative_steps", 0) or 0)
    return torch.zeros((input_batch.num_reqs, k), dtype=torch.int64,
                       device=getattr(runner, "device", None))


def _skippable(runner: Any) -> bool:
    pc = getattr(runner, "parallel_config", None)
    return (getattr(pc, "pipeline_parallel_size", 1) == 1
            and getattr(pc, "data_parallel_size", 1) == 1)


def _make_sample(original: Any) -> Any:
    """Keeps this step's input batch and sampled tokens for the speculator's
    propose (sample_tokens calls sample(), postprocess_sampled, then
    propose with the same input batch)."""
    def sample(self: Any, hidden_states: Any, input_batch: Any,
               grammar_output: Any) -> Any:
        out = original(self, hidden_states, input_batch, grammar_output)
        sampler_output, num_sampled = out[0], out[1]
        self.__dict__[_SAMPLED_ATTR] = (
            input_batch, sampler_output.sampled_token_ids, num_sampled)
        return out

    return sample


def _make_take_draft_token_ids(original: Any) -> Any:
    from vllm_patch.v1.spec_decode.grammar_end import withhold_drafts

    def take_draft_token_ids(self: Any) -> Any:
        return withhold_drafts(original(self), self.__dict__.get(_DROP_ATTR))

    return take_draft_token_ids


def _make_execute_model(original: Any) -> Any:
    """G1: tells the draft handler which scheduler step runs, so the drafts
    this step's sample_tokens proposes are kept under it
    (vllm_patch.v1.worker.gpu.spec_decode.utils)."""
    from vllm_patch.v1.worker.gpu.spec_decode.utils import note_step

    def execute_model(self: Any, scheduler_output: Any, *args: Any,
                      **kwargs: Any) -> Any:
        handler = self.__dict__.get("draft_tokens_handler")
        if handler is not None:
            dummy = bool(kwargs.get("dummy_run", args[1] if len(args) > 1 else False))
            note_step(handler, scheduler_output, dummy)
        return original(self, scheduler_output, *args, **kwargs)

    return execute_model


_V2 = "vllm.v1.worker.gpu.model_runner:GPUModelRunner."
_PIN_SAMPLE_TOKENS = pin(
    _V2 + "sample_tokens",
    "last PP rank: sample() with this step's input batch, then "
    "postprocess_sampled(idx_mapping, sampled_token_ids, num_sampled, ...), "
    "then self.speculator.propose(input_batch, ...) whose return is stored "
    "in req_states.draft_tokens and handed to DraftTokensHandler")
_WHY = ("Model Runner V2's speculator proposes drafts (EAGLE / draft_model: k "
        "forward passes) for requests whose grammar ends in this step or "
        "ended in the previous one under async scheduling, and hands them to "
        "the scheduler: G2 finishes those requests, the drafts are never used")
_REMOVE = "vLLM skips drafting for requests finishing in the step"
# Optional: without them G3's acceptance guarantee still holds on V2 (V2's
# grammar_invalid_drafts + the scheduler-side rows); only the draft skip and
# withholding are lost.
_WITHOUT = ("on Model Runner V2 the speculator keeps drafting after a "
            "grammar's end; those drafts are still rejected")
_UPSTREAM = "SGLang PR #24082 (no drafts for finished grammars); vLLM has none"

PATCHES: list[Patch] = [
    Patch(
        name="g3-v2-grammar-end-stop-tokens",
        guarantee="G3",
        target=_V2 + "add_requests",
        versions=("0.32", "0.33"),
        signature=("self", "scheduler_output"),
        make=_make_add_requests,
        why=_WHY + " (V2 keeps no sampling parameters: the stop tokens a "
             "grammar ends on are recorded here)",
        how="records each new request's structured flag and grammar stop "
            "tokens (grammar_end.stop_set) before the stock method",
        upstream=_UPSTREAM, remove_when=_REMOVE, required=False, without=_WITHOUT,
        pins=(pin(_V2 + "add_requests",
                  "new requests arrive as scheduler_output.scheduled_new_reqs "
                  "with their sampling_params"),),
    ),
    Patch(
        name="g3-v2-step-context",
        guarantee="G3",
        target=_V2 + "sample_tokens",
        versions=("0.32", "0.33"),
        signature=("self", "grammar_output"),
        make=_make_sample_tokens,
        why=_WHY + " (the decision needs this step's grammar output)",
        how="counts steps, keeps grammar_output for the step and routes the "
            "speculator's propose through the draft-skip decision for this "
            "step only",
        upstream=_UPSTREAM, remove_when=_REMOVE, required=False, without=_WITHOUT, pins=(_PIN_SAMPLE_TOKENS,),
    ),
    Patch(
        name="g3-v2-no-drafts-after-grammar-end",
        guarantee="G3",
        target=_V2 + "sample",
        versions=("0.32", "0.33"),
        signature=("self", "hidden_states", "input_batch", "grammar_output"),
        make=_make_sample,
        why=_WHY,
        how=("keeps the step's sampled tokens; at the speculator's propose "
             "(same step): which requests end (grammar_end, as on the V1 "
             "runner); all: the speculator is not run this step (propose "
             "answers zero drafts, never handed over); some: their drafts are withheld "
             "at hand-over. Never skipped under pipeline or data parallelism. "
             "Needs g3-v2-step-context and G2's commit cut"),
        upstream=_UPSTREAM, remove_when=_REMOVE, required=False, without=_WITHOUT,
        pins=(_PIN_SAMPLE_TOKENS,
              pin(_V2 + "sample",
                  "returns (sampler_output, num_sampled, num_rejected); "
                  "sampler_output.sampled_token_ids is [num_reqs, k + 1]"),
              pin("vllm.v1.structured_output:StructuredOutputManager"
                  ".grammar_bitmask",
                  "bitmask row layout read by grammar_end.request_rows "
                  "(the patch series' build keeps it)", on_build=True)),
    ),
    Patch(
        name="g3-v2-no-drafts-handed-over-after-grammar-end",
        guarantee="G3",
        target=_V2 + "take_draft_token_ids",
        versions=("0.32", "0.33"),
        signature=("self",),
        make=_make_take_draft_token_ids,
        why=("Model Runner V2 hands the scheduler drafts of requests whose "
             "grammar ended (in a batch where others go on)"),
        how=("requests found ended in the last step get an empty draft list; "
             "the scheduler then schedules none for them"),
        upstream=_UPSTREAM, remove_when=_REMOVE, required=False, without=_WITHOUT,
        pins=(pin(_V2 + "take_draft_token_ids",
                  "returns DraftTokensHandler's DraftTokenIds (req_ids, one "
                  "draft list per request)"),
              pin("vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids",
                  "an empty draft list leaves the request without spec tokens"),),
    ),
    Patch(
        name="g1-v2-step-drafts-step",
        guarantee="G1",
        target=_V2 + "execute_model",
        versions=("0.32", "0.33"),
        signature=("self", "scheduler_output", "intermediate_tensors",
                   "dummy_run", "skip_attn_for_dummy_run", "is_profile",
                   "context_len", "valid_dummy_state_slots",
                   "randomize_inputs"),
        make=_make_execute_model,
        why=("with pipeline parallelism + async scheduling, Model Runner V2 "
             "hands the scheduler drafts through one slot that every step "
             "overwrites; keying them by step needs the step on the worker"),
        how=("before the stock method, notes the scheduler's step stamp of "
             "the scheduler output (none for a dummy run) on the draft "
             "handler; that step's sample_tokens records its drafts under it"),
        upstream="vLLM issue #54437; vLLM PR #56802 (open) keys draft "
                 "snapshots by step",
        remove_when="vLLM keys drafts by scheduler step",
        required=False,
        without=("with pipeline parallelism + async scheduling on Model "
                 "Runner V2, structured requests get no validated drafts"),
        pins=(pin(_V2 + "sample_tokens",
                  "the step's drafts are handed to DraftTokensHandler."
                  "set_draft_tokens in the sample_tokens that follows this "
                  "step's execute_model"),),
    ),
]


# Grammar-aware drafting on Model Runner V2 (not a guarantee: drafting
# speed): the request parameters and the step's sampled tokens the walk in
# vllm_patch.v1.worker.gpu.spec_decode.speculator needs.

def _make_update_requests(original: Any) -> Any:
    from vllm_patch.v1.worker.gpu.spec_decode import speculator as v2drafts

    def update_requests(self: Any, scheduler_output: Any) -> Any:
        out = original(self, scheduler_output)
        try:
            v2drafts.record_requests(self, scheduler_output)
        except Exception:  # noqa: BLE001 - drafting help must never fail a step
            logger.warning("vllm_patch: grammar-aware drafting failed; stock "
                           "drafting", exc_info=True)
        return out

    return update_requests


def _make_postprocess_sampled(original: Any) -> Any:
    from vllm_patch.v1.worker.gpu.spec_decode import speculator as v2drafts

    def postprocess_sampled(self: Any, idx_mapping: Any, sampled_tokens: Any,
                            num_sampled: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, idx_mapping, sampled_tokens, num_sampled,
                       *args, **kwargs)
        if getattr(self, "is_last_pp_rank", True) and \
                getattr(self, "speculator", None) is not None:
            try:
                v2drafts.after_sampled(self, idx_mapping, sampled_tokens,
                                       num_sampled)
            except Exception:  # noqa: BLE001
                logger.warning("vllm_patch: grammar-aware drafting failed; "
                               "stock drafting", exc_info=True)
                v2drafts.off(self.speculator, "internal error")
        return out

    return postprocess_sampled


_GD_WHY = ("grammar-aware drafting on Model Runner V2 needs each structured "
           "request's sampling parameters (V2 keeps none) and the tokens "
           "sampled in each step, before the speculator drafts")
_GD_UPSTREAM = ("vLLM PR #45400 (forced tokens as drafts, Model Runner V2) "
                "and #47885 (grammar-aware draft sampling) are open")
_GD_REMOVE = "vLLM's V2 speculators draft under the grammar themselves"
_GD_POST = ("after the stock method (last pipeline rank, with a "
            "speculator): the step's sampled tokens advance each structured "
            "request's shadow grammar, and the rows that draft under a "
            "grammar in this step's propose are chosen")
_GD_SIG = ("self", "idx_mapping", "sampled_tokens", "num_sampled",
           "num_rejected", "query_start_loc")

PATCHES += [
    Patch(
        name="v2-grammar-drafts-requests",
        guarantee="package",
        target=_V2 + "update_requests",
        versions=("0.32", "0.33"),
        signature=("self", "scheduler_output"),
        make=_make_update_requests,
        why=_GD_WHY,
        how=("after the stock method, keeps each new structured request's "
             "sampling parameters and earlier output tokens; forgets "
             "finished requests"),
        upstream=_GD_UPSTREAM, remove_when=_GD_REMOVE,
    ),
    Patch(
        name="v2-grammar-drafts-sampled",
        guarantee="package",
        target=_V2 + "postprocess_sampled",
        versions=("0.33",),
        signature=_GD_SIG + ("draft_tokens",),
        make=_make_postprocess_sampled,
        why=_GD_WHY, how=_GD_POST,
        upstream=_GD_UPSTREAM, remove_when=_GD_REMOVE,
        pins=(_PIN_SAMPLE_TOKENS,),
    ),
    Patch(
        name="v2-grammar-drafts-sampled-0.32",
        guarantee="package",
        target=_V2 + "postprocess_sampled",
        versions=("0.32",),
        signature=_GD_SIG,
        make=_make_postprocess_sampled,
        why=_GD_WHY, how=_GD_POST + " (vLLM 0.32's signature)",
        upstream=_GD_UPSTREAM, remove_when=_GD_REMOVE,
        pins=(_PIN_SAMPLE_TOKENS,),
    ),
]
