"""Grammar-aware drafting in vllm.v1.spec_decode.llm_base_proposer (the
base class of the EAGLE / EAGLE3 / MTP and draft-model drafters): masked
drafts and forced drafts (`VLLM_PATCH_MASKED_DRAFTS`,
`VLLM_PATCH_FORCED_DRAFTS`, both on by default). The logic and its design
are in `vllm_patch.v1.spec_decode.grammar_drafts`.

Four hooks on SpecDecodeBaseProposer, each a registered patch:
- `prepare_next_token_ids_padded` / `prepare_next_token_ids_cpu`: the runner
  hands the drafter this step's sampled tokens here (before it drafts, and
  also when the drafter is skipped); each structured request's shadow
  grammar accepts them;
- `propose`: which rows draft under a grammar; afterwards every shadow is
  rolled back to the committed state (also when propose raises);
- `_sample_draft_tokens`: the one place each draft position's hidden
  states become token ids; structured rows are masked by their shadow's
  bitmask before the argmax (or before probabilistic draft sampling, whose
  draft probabilities are then the masked, renormalised ones), a position
  with one allowed token gets it, and the chosen token walks the shadow.
Unstructured rows and requests without a shadow go through stock code.
"""

from __future__ import annotations

from typing import Any

from vllm_patch.audited import pin
from vllm_patch.patching import Patch
from vllm_patch.v1.spec_decode import grammar_drafts as gd

_BASE = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer."


def _make_prepare_padded(original: Any) -> Any:
    def prepare_next_token_ids_padded(self: Any, sampled_token_ids: Any,
                                      requests: Any, gpu_input_batch: Any,
                                      discard_request_mask: Any) -> Any:
        out = original(self, sampled_token_ids, requests, gpu_input_batch,
                       discard_request_mask)
        try:
            if gd.wants_tokens(self) and any(
                    getattr(getattr(requests.get(r), "sampling_params", None),
                            "structured_outputs", None) is not None
                    for r in gpu_input_batch.req_ids):
                n = len(gpu_input_batch.req_ids)
                t = self.__dict__[gd.TRACKER_ATTR]
                gd.advance(self, requests, gpu_input_batch.req_ids,
                           gd._to_host(t, sampled_token_ids[:n]),
                           discard_request_mask[:n].tolist())
        except Exception:  # noqa: BLE001 - drafting help must never fail a step
            gd.logger.warning("vllm_patch: grammar-aware drafting failed; "
                              "stock drafting", exc_info=True)
            self.__dict__[gd.TRACKER_ATTR].reason_off = "internal error"
        return out

    return prepare_next_token_ids_padded


def _make_prepare_cpu(original: Any) -> Any:
    def prepare_next_token_ids_cpu(self: Any, sampled_token_ids: Any,
                                   requests: Any, gpu_input_batch: Any,
                                   num_scheduled_tokens: Any) -> Any:
        out = original(self, sampled_token_ids, requests, gpu_input_batch,
                       num_scheduled_tokens)
        try:
            if gd.wants_tokens(self):
                gd.advance(self, requests, gpu_input_batch.req_ids,
                           sampled_token_ids,
                           [not ids for ids in sampled_token_ids],
                           outputs_include_step=True)
        except Exception:  # noqa: BLE001
            gd.logger.warning("vllm_patch: grammar-aware drafting failed; "
                              "stock drafting", exc_info=True)
            self.__dict__[gd.TRACKER_ATTR].reason_off = "internal error"
        return out

    return prepare_next_token_ids_cpu


def _make_propose(original: Any) -> Any:
    def propose(self: Any, *args: Any, **kwargs: Any) -> Any:
        cad = kwargs.get("common_attn_metadata")
        t = self.__dict__.get(gd.TRACKER_ATTR)
        if t is None or t.reason_off or not t.shadows or cad is None:
            return original(self, *args, **kwargs)
        gd.begin(self, cad.batch_size())
        try:
            return original(self, *args, **kwargs)
        finally:
            gd.end(self)

    return propose


def _make_sample_draft_tokens(original: Any) -> Any:
    def _sample_draft_tokens(self: Any, hidden_states: Any,
                             sampling_metadata: Any) -> Any:
        t = self.__dict__.get(gd.TRACKER_ATTR)
        if t is None or t.rows is None:
            return original(self, hidden_states, sampling_metadata)
        return gd.sample(self, original, hidden_states, sampling_metadata)

    return _sample_draft_tokens


_WHY = ("speculative decoding loses most drafts on structured outputs: the "
        "drafter proposes its unconstrained choice and the grammar rejects "
        "it at the first forbidden token (even a drafter identical to the "
        "target gets about 1.1 tokens per step instead of k + 1)")
_UPSTREAM = ("vLLM PR #47885 (grammar-aware draft sampling, shadow matcher) "
             "and #45400 (forced tokens as drafts, Model Runner V2) are open; "
             "SGLang #17062; lmdeploy #4559")
_REMOVE = "vLLM drafts under the grammar itself (PR #47885 or successor)"

PATCHES: list[Patch] = [
    Patch(
        name="grammar-drafts-track-sampled-padded",
        guarantee="package",
        target=_BASE + "prepare_next_token_ids_padded",
        versions=("0.32", "0.33"),
        signature=("self", "sampled_token_ids", "requests", "gpu_input_batch",
                   "discard_request_mask"),
        make=_make_prepare_padded,
        why=_WHY,
        how=("after the stock method, each structured request's shadow "
             "grammar (a second grammar compiled by the scheduler's backend, "
             "or by the worker's own in multiprocess workers; never the "
             "committed one) accepts the tokens sampled for it in "
             "this step (-1 = rejected; discarded partial-prefill rows "
             "skipped); a shadow that refuses one is dropped (stock drafting "
             "for that request)"),
        upstream=_UPSTREAM, remove_when=_REMOVE,
    ),
    Patch(
        name="grammar-drafts-track-sampled-cpu",
        guarantee="package",
        target=_BASE + "prepare_next_token_ids_cpu",
        versions=("0.32", "0.33"),
        signature=("self", "sampled_token_ids", "requests", "gpu_input_batch",
                   "num_scheduled_tokens"),
        make=_make_prepare_cpu,
        why=_WHY,
        how=("as grammar-drafts-track-sampled-padded, for drafting on CPU "
             "tokens (disable_padded_drafter_batch)"),
        upstream=_UPSTREAM, remove_when=_REMOVE,
    ),
    Patch(
        name="grammar-drafts-propose-context",
        guarantee="package",
        target=_BASE + "propose",
        versions=("0.32", "0.33"),
        signature=("self", "num_speculative_tokens", "target_token_ids",
                   "target_positions", "target_hidden_states",
                   "next_token_ids", "token_indices_to_sample",
                   "common_attn_metadata", "sampling_metadata",
                   "mm_embed_inputs", "num_rejected_tokens_gpu",
                   "slot_mappings"),
        make=_make_propose,
        why=_WHY,
        how=("marks the batch rows that have a shadow grammar for the "
             "draft positions of this call, and rolls every shadow back to "
             "the committed state afterwards (also on error)"),
        upstream=_UPSTREAM, remove_when=_REMOVE,
    ),
    Patch(
        name="grammar-drafts-masked-sampling",
        guarantee="package",
        target=_BASE + "_sample_draft_tokens",
        versions=("0.32", "0.33"),
        signature=("self", "hidden_states", "sampling_metadata"),
        make=_make_sample_draft_tokens,
        why=_WHY,
        how=("per draft position, rows with a shadow grammar get its "
             "bitmask: masked drafts (VLLM_PATCH_MASKED_DRAFTS) apply it to "
             "the drafter's logits before the argmax, or before probabilistic "
             "draft sampling (the draft probabilities are then the masked, "
             "renormalised ones the rejection sampler needs); forced drafts "
             "(VLLM_PATCH_FORCED_DRAFTS) put the only allowed token where the "
             "grammar allows one (draft probability one-hot); the chosen "
             "token walks the shadow; after the grammar's end the request "
             "hands over no more drafts. Other rows: stock"),
        upstream=_UPSTREAM, remove_when=_REMOVE,
        pins=(pin("vllm.v1.structured_output.backend_guidance:"
                  "GuidanceGrammar.validate_tokens",
                  "counts with self.ll_matcher.validate_tokens, nothing once "
                  "the matcher stopped (a guidance shadow's try is one "
                  "try_consume_tokens of the same matcher)"),
              pin("vllm.v1.structured_output.backend_guidance:"
                  "GuidanceGrammar.accept_tokens",
                  "tokens without the stop token are consumed by "
                  "self.ll_matcher and nothing else changes",
                  on_build=True)),
    ),
]
