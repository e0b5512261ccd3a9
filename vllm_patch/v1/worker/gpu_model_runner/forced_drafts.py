"""Forced drafts for the V1 runner's drafters without a model: ngram (on the
CPU) and suffix decoding (`VLLM_PATCH_FORCED_DRAFTS`, on by default).

For a structured request the drafts become: the grammar's forced
continuation (`vllm_patch.v1.spec_decode.forced_drafts.forced_tokens`,
tokenized as the model's tokenizer does), then the proposer's own drafts
for the text after it, kept only as far as the grammar takes them. Where
the proposer finds nothing (no n-gram match, an empty suffix tree), the
forced continuation alone fills the slots. Stock proposes n-grams of the
prompt (a schema, say) that the grammar cuts at their first forbidden
token, so a structured request drafts next to nothing.

Where: `GPUModelRunner._copy_draft_token_ids_to_cpu`, after the stock
method: the runner calls it right after `propose_draft_token_ids` with the
step's drafts in `_draft_token_ids` (a list per batch row for these
drafters), before anything reads them (`take_draft_token_ids`). These
drafters run after the runner's bookkeeping, so the step's tokens are
already in each request's `output_token_ids` (ngram and suffix decoding
run with sync scheduling only: vLLM turns async scheduling off for them).
Each structured request's shadow grammar (`grammar_drafts`: a second
grammar compiled by the scheduler's backend, or by the worker's own in
multiprocess workers) is advanced here by the outputs it has not seen
yet (counted per request, so a step without drafting, such as one whose
input does not fit the drafter, is caught up), walked over the forced
tokens and the proposer's drafts, and rolled back.

"The proposer's own drafts after the forced continuation": ngram looks up
its n-gram again with the forced tokens appended to the context (vLLM's
own matching function); suffix decoding asks its suffix tree with the
forced tokens appended to the pattern. Nothing else changes for
unstructured requests or requests without a shadow: stock drafts.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from vllm_patch.audited import pin
from vllm_patch.patching import Patch
from vllm_patch.v1.spec_decode import grammar_drafts as gd
from vllm_patch.v1.spec_decode.forced_drafts import CONTEXT_TOKENS, forced_tokens

logger = logging.getLogger(__name__)

MODEL_FREE = ("ngram", "suffix")
# drafter attribute: req_id -> output length the shadow has consumed.
_SEEN_ATTR = "_vllm_patch_forced_seen"
STATS = ("forced_rows", "forced_drafts", "proposer_drafts_kept",
         "proposer_drafts_dropped")


def _make_copy_drafts(original: Any) -> Any:
    def _copy_draft_token_ids_to_cpu(self: Any, scheduler_output: Any,
                                     zeros_only: bool = False) -> None:
        original(self, scheduler_output, zeros_only)
        drafts = getattr(self, "_draft_token_ids", None)
        spec = getattr(self, "speculative_config", None)
        if (zeros_only or not isinstance(drafts, list)
                or getattr(spec, "method", None) not in MODEL_FREE
                or not getattr(scheduler_output,
                               "has_structured_output_requests", False)):
            return
        try:
            self._draft_token_ids = forced_first(self, scheduler_output, drafts)
        except Exception:  # noqa: BLE001 - drafting help must never fail a step
            logger.warning("vllm_patch: forced drafts failed; stock drafting",
                           exc_info=True)
            t = self.drafter.__dict__.get(gd.TRACKER_ATTR)
            if t is not None:
                t.reason_off = "internal error"

    return _copy_draft_token_ids_to_cpu


def forced_first(runner: Any, scheduler_output: Any,
                 drafts: list[list[int]]) -> list[list[int]]:
    """The drafts of this step with every structured request's forced
    continuation first (module docstring)."""
    drafter = runner.drafter
    if getattr(drafter, "vllm_config", None) is None:
        # grammar_drafts compiles shadows with the drafter's config; these
        # proposers keep only the values they read from it.
        drafter.vllm_config = runner.vllm_config
    t = gd.tracker(drafter, model_free=True)
    if t is None or not t.forced:
        return drafts
    req_ids = list(runner.input_batch.req_ids)
    advance(drafter, t, runner.requests, req_ids)
    if t.reason_off or t.manager is None:
        return drafts
    backend = t.manager.backend
    tokenizer = getattr(backend, "tokenizer", None) or t.manager.tokenizer
    # The scheduler's draft budget for this step (dynamic speculative
    # decoding can make it smaller than, or 0 of, the configured k).
    k = int(getattr(scheduler_output, "num_spec_tokens_to_schedule",
                    runner.num_spec_tokens))
    if k <= 0:
        return drafts
    for key in STATS:
        t.stats.setdefault(key, 0)
    drafts = list(drafts)
    for i, req_id in enumerate(req_ids):
        shadow = t.shadows.get(req_id)
        if shadow is None or i >= len(drafts) \
                or not runner.requests[req_id].output_token_ids:
            continue
        drafts[i] = _row(runner, t, i, req_id, shadow.grammar,
                         list(drafts[i]), k, tokenizer)
    return drafts


def advance(drafter: Any, t: Any, requests: dict,
            req_ids: Sequence[str]) -> None:
    """Every structured request's shadow takes the outputs it has not seen
    (grammar_drafts.advance builds the missing shadows from all outputs).
    A shadow whose count does not fit the outputs is rebuilt."""
    seen = drafter.__dict__.setdefault(_SEEN_ATTR, {})
    for req_id in [r for r in seen if r not in requests]:
        del seen[req_id]
    rows: list[list[int]] = []
    for req_id in req_ids:
        out = getattr(requests.get(req_id), "output_token_ids", ())
        done = seen.get(req_id)
        if req_id in t.shadows and (done is None or done > len(out)):
            del t.shadows[req_id]
        rows.append(list(out[done:]) if req_id in t.shadows else [])
    gd.advance(drafter, requests, req_ids, rows, [False] * len(req_ids),
               outputs_include_step=True)
    for req_id in req_ids:
        if req_id in t.shadows:
            seen[req_id] = len(requests[req_id].output_token_ids)


def _row(runner: Any, t: Any, i: int, req_id: str, grammar: Any,
         own: list[int], k: int, tokenizer: Any) -> list[int]:
    """One structured request's drafts: forced continuation, then the
    proposer's drafts after it as far as the grammar takes them."""
    if grammar.is_terminated():
        return []  # nothing after the grammar's end (G3)
    recent = runner.requests[req_id].output_token_ids[-CONTEXT_TOKENS:]
    forced = forced_tokens(grammar, recent, tokenizer, k, keep_walked=True,
                           request_id=req_id)
    try:
        room = k - len(forced)
        if forced:
            t.stats["forced_rows"] += 1
            t.stats["forced_drafts"] += len(forced)
            after = _propose_after(runner, i, req_id, forced, room) \
                if room > 0 else []
            if after is None:
                # The proposer cannot look again: its drafts where they
                # agree with the forced ones.
                after = own[len(forced):] if own[:len(forced)] == forced else []
            own = after
        own = own[:max(room, 0)]
        kept = list(grammar.validate_tokens(own)) if own else []
    finally:
        if forced:
            grammar.rollback(len(forced))
    t.stats["proposer_drafts_kept"] += len(kept)
    t.stats["proposer_drafts_dropped"] += len(own) - len(kept)
    return forced + kept


def _propose_after(runner: Any, i: int, req_id: str, forced: list[int],
                   room: int) -> list[int] | None:
    """The proposer's drafts for the text after the forced tokens (None: it
    cannot be asked)."""
    import numpy as np

    drafter = runner.drafter
    batch = runner.input_batch
    n = int(batch.num_tokens_no_spec[i])
    method = runner.speculative_config.method
    if method == "ngram":
        # Not pinned: importing vllm.v1.spec_decode.ngram_proposer imports
        # numba, and numba imported before a CPU worker starts makes vLLM's
        # Triton-kernel override scan (triton_utils.dispatcher) fail on an
        # llvmlite object. Checked here instead: the n-gram matcher vLLM's
        # NgramProposer.propose drafts each row with,
        # (tokens, min_n, max_n, max_model_len, k) -> up to k tokens.
        from vllm.v1.spec_decode import ngram_proposer

        find = getattr(ngram_proposer,
                       "_find_longest_matched_ngram_and_propose_tokens", None)
        if find is None:
            return None
        row = batch.token_ids_cpu[i, :n]
        context = np.concatenate([row, np.asarray(forced, dtype=row.dtype)])
        if context.shape[0] >= drafter.max_model_len:
            return []
        out = find(context, drafter.min_n, drafter.max_n,
                   drafter.max_model_len, room)
        return [int(x) for x in out]
    if method == "suffix":
        cache = drafter.suffix_cache
        if req_id not in cache.active_requests:
            return None
        total = n + len(forced)
        start = max(0, total - drafter.max_tree_depth)
        pattern = np.concatenate([batch.token_ids_cpu[i, :n],
                                  np.asarray(forced, dtype=batch.token_ids_cpu.dtype)])
        draft = cache.speculate(
            req_id, pattern[start:],
            max_spec_tokens=min(room, drafter.max_model_len - total - 1),
            max_spec_factor=drafter.max_spec_factor,
            min_token_prob=drafter.min_token_prob)
        return [int(x) for x in draft.token_ids]
    return None


def _enabled(settings: Any) -> bool:
    return settings.forced_drafts


PATCHES: list[Patch] = [
    Patch(
        name="grammar-drafts-forced-model-free",
        guarantee="package",
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner"
               "._copy_draft_token_ids_to_cpu",
        versions=("0.32", "0.33"),
        signature=("self", "scheduler_output", "zeros_only"),
        make=_make_copy_drafts,
        enabled=_enabled,
        why=("ngram and suffix decoding propose text of the prompt or of "
             "earlier outputs that the grammar cuts at its first forbidden "
             "token: structured requests get almost no drafts, although the "
             "grammar itself forces 13-15 % of a JSON output's tokens"),
        how=("after the stock method, for each structured request with a "
             "shadow grammar (advanced here by the outputs it has not "
             "seen): drafts = the grammar's forced continuation tokenized as "
             "the model's tokenizer does, then the proposer's own drafts for "
             "the text after it (ngram: its n-gram matched again with the "
             "forced tokens appended; suffix decoding: its tree asked with "
             "them appended) as far as the grammar takes them; the shadow is "
             "rolled back. No drafts after a grammar's end. Other requests: "
             "stock"),
        upstream=("SGLang #17062 (llguidance fast-forward tokens as drafts), "
                  "vLLM #45400 (forced tokens as drafts, Model Runner V2, "
                  "open); vllm-metal #650"),
        remove_when="vLLM drafts a grammar's forced continuation itself",
        pins=(
            pin("vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
                "with ngram / suffix decoding it calls propose_draft_token_ids "
                "after _bookkeeping_sync (the step's tokens are in "
                "output_token_ids, token_ids_cpu and num_tokens_no_spec), "
                "stores the list it returns in _draft_token_ids and then "
                "calls _copy_draft_token_ids_to_cpu(scheduler_output)",
                on_build=True),
            pin("vllm.v1.worker.gpu_model_runner:GPUModelRunner"
                "._copy_draft_token_ids_to_cpu",
                "leaves a list of drafts in _draft_token_ids untouched "
                "(it copies tensors only)"),
            pin("vllm.v1.worker.gpu_model_runner:GPUModelRunner"
                ".propose_draft_token_ids",
                "its ngram and suffix branches return one list of drafts per "
                "batch row (input_batch.req_ids order)",
                on_build=True),
            pin("vllm.v1.spec_decode.suffix_decoding:SuffixDecodingProposer"
                ".propose",
                "speculate(req_id, pattern, max_spec_tokens, "
                "max_spec_factor, min_token_prob) on the request's active "
                "suffix tree, pattern = the last max_tree_depth tokens"),
        ),
    ),
]
