"""Grammar-aware drafting in vllm.v1.worker.gpu.spec_decode.speculator
(Model Runner V2): masked drafts and forced drafts
(`VLLM_PATCH_MASKED_DRAFTS`, `VLLM_PATCH_FORCED_DRAFTS`) for V2's
autoregressive EAGLE / MTP speculators (`TargetDependentARSpeculator`) and
its draft-model speculator (`StandaloneARSpeculator`). The walk is V1's:
`vllm_patch.v1.spec_decode.grammar_drafts` (shadow grammars, `advance`,
`begin`, `_walk`, `end`, the cost model and its counters); this module only
feeds it V2's data.

Where, in one V2 step (`GPUModelRunner.sample_tokens`: sample, then
`postprocess_sampled`, then `speculator.propose`):
- `GPUModelRunner.update_requests` (patched in
  vllm_patch.v1.worker.gpu.model_runner): each new request's sampling
  parameters and earlier output tokens are kept on the runner (V2 keeps
  no sampling parameters itself); finished requests are forgotten;
- `GPUModelRunner.postprocess_sampled` (same module): the step's sampled
  tokens (accepted drafts + bonus token, `num_sampled` per row) advance
  each structured request's shadow grammar (`after_sampled` below), and
  the rows that draft under a grammar are chosen for the propose that
  follows (`grammar_drafts.begin`);
- `DraftModelSpeculator.sample_draft` (this module): the one place V2's
  AR speculators turn a draft position's hidden states into token ids
  (prefill position, then each decode position; the returned ids are the
  next position's input). Greedy drafting: the position's logits and
  argmax go through `grammar_drafts._walk` (candidates, the first one the
  grammar allows, a bitmask only for rows that refused them all, forced
  tokens); the walked shadows are rolled back after the last position
  (`grammar_drafts.end`), at the latest at the next step's
  `postprocess_sampled`.

CUDA graphs: V2 captures the EAGLE / MTP draft prefill and the whole
multi-step decode loop (all k - 1 positions, sample_draft included) as FULL
graphs; a replay runs no Python, so no walk. In a step where some row
walks its grammar, this speculator's graph dispatch answers eager
(`CUDAGraphMode.NONE`, as vLLM's own profile run) for that propose only:
the drafting loop runs eagerly, sample_draft in Python per position. Steps
without walking rows (no structured request, the cost model keeping stock,
every grammar ended) replay the captured graphs as in stock. Piecewise
graphs keep the model's pieces captured. The draft-model speculator
(StandaloneAR) has no CUDA graphs in vLLM. Data parallel > 1: off (the
graph agreement across ranks is not changed here).

Not covered (stock drafting, said once in the log): probabilistic draft
sampling (`draft_sample_method="probabilistic"`: V2 caches the draft
logits as the rejection sampler's proposal distribution), local argmax
reduction, draft watermarking, parallel drafters (DFlash and its kin,
multi-module MTP), ngram.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from vllm_patch.patching import Patch
from vllm_patch.v1.spec_decode import grammar_drafts as gd

# On the runner: req_id -> [sampling params, earlier outputs or None].
REQUESTS_ATTR = "_vllm_patch_v2_draft_requests"
# On the speculator: graph managers whose dispatch answers eager this step.
_EAGER_ATTR = "_vllm_patch_v2_eager_managers"

_AR_CLASSES = (
    ("vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator",
     "TargetDependentARSpeculator"),
    ("vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator",
     "StandaloneARSpeculator"),
)


def _ar_classes() -> tuple[type, ...]:
    import importlib

    out = []
    for module, name in _AR_CLASSES:
        try:
            out.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(out)


def eligible(speculator: Any) -> bool:
    """V2 speculators whose drafts come from `sample_draft` one position at a
    time over the full target vocabulary, greedily (draft_logits None)."""
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    classes = _ar_classes()
    return (isinstance(speculator, DraftModelSpeculator)
            and bool(classes) and isinstance(speculator, classes)
            and getattr(speculator, "draft_logits", None) is None
            and getattr(speculator, "draft_watermarker", None) is None
            and not getattr(speculator, "use_local_argmax_reduction", False)
            and int(getattr(speculator, "dp_size", 1) or 1) == 1)


def _tracker(speculator: Any) -> gd.Tracker | None:
    if speculator is None:
        return None
    d = getattr(speculator, "__dict__", None)
    if d is None:
        return None
    if gd.TRACKER_ATTR not in d:
        # grammar_drafts reads the draft count under V1's name.
        d.setdefault("num_speculative_tokens",
                     int(getattr(speculator, "num_speculative_steps", 1) or 1))
    return gd.tracker(speculator)


def record_requests(runner: Any, scheduler_output: Any) -> None:
    """New requests' sampling parameters (structured ones only) and the
    output tokens they already have (a resumed request); finished ones
    dropped. Called by the patched GPUModelRunner.update_requests."""
    if _tracker(getattr(runner, "speculator", None)) is None:
        return
    known: dict = runner.__dict__.setdefault(REQUESTS_ATTR, {})
    for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
        known.pop(req_id, None)
    for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
        params = getattr(new, "sampling_params", None)
        if getattr(params, "structured_outputs", None) is None:
            known.pop(new.req_id, None)
            continue
        if new.req_id in known:
            continue  # resumed after preemption: its shadow is in step
        tokens = getattr(new, "prefill_token_ids", None)
        prompt_len = getattr(new, "prompt_len", None)
        if prompt_len is None:
            prompt_len = len(getattr(new, "prompt_token_ids", None) or ())
        earlier = list(tokens[prompt_len:]) if tokens is not None else None
        known[new.req_id] = [params, earlier]


def after_sampled(runner: Any, idx_mapping: Any, sampled_tokens: Any,
                  num_sampled: Any) -> None:
    """The step's sampled tokens: the shadows advance, and the rows that
    draft under a grammar in the propose that follows are chosen. Called by
    the patched GPUModelRunner.postprocess_sampled (last pipeline rank)."""
    speculator = getattr(runner, "speculator", None)
    t = _tracker(speculator)
    finish(speculator)  # a propose that did not reach its last position
    if t is None or not gd.wants_tokens(speculator):
        return
    known: dict = runner.__dict__.get(REQUESTS_ATTR) or {}
    if not known:
        return
    import torch

    index_to_req_id = runner.req_states.index_to_req_id
    t0 = time.thread_time_ns()
    n = int(idx_mapping.shape[0])
    width = int(sampled_tokens.shape[1]) if sampled_tokens.dim() > 1 else 1
    # One read: batch slots, sampled counts, sampled tokens.
    flat = gd._to_host(t, torch.cat([
        idx_mapping[:n].reshape(-1).long(), num_sampled[:n].reshape(-1).long(),
        sampled_tokens[:n].reshape(-1).long()]))
    t.cost.charge(t0, upkeep=True)
    req_ids = [index_to_req_id.get(int(i)) if int(i) >= 0 else None
               for i in flat[:n]]
    if not any(r in known for r in req_ids):
        return
    counts = flat[n:2 * n]
    sampled = [flat[2 * n + r * width:2 * n + r * width + int(c)]
               for r, c in enumerate(counts)]
    requests = {
        req_id: SimpleNamespace(
            sampling_params=entry[0],
            output_token_ids=entry[1] if entry[1] is not None else [-1])
        for req_id, entry in known.items()}
    gd.advance(speculator, requests, req_ids, sampled,
               [int(c) == 0 for c in counts])
    for req_id, c in zip(req_ids, counts):
        if req_id in known and int(c) > 0:
            known[req_id][1] = None  # later shadows: history unknown
    gd.begin(speculator, n)
    if t.rows is not None:
        _eager_this_step(speculator)


def finish(speculator: Any) -> None:
    """Roll the walked shadows back and give the graphs back."""
    if speculator is None:
        return
    d = getattr(speculator, "__dict__", None)
    if d is None:
        return
    for manager in d.pop(_EAGER_ATTR, ()):
        manager.__dict__.pop("dispatch", None)
    gd.end(speculator)


def off(speculator: Any, reason: str) -> None:
    """Stock drafting in this worker from now on."""
    t = getattr(speculator, "__dict__", {}).get(gd.TRACKER_ATTR)
    if t is not None:
        finish(speculator)
        t.reason_off = reason


def _eager_this_step(speculator: Any) -> None:
    """The speculator's FULL graph replays become eager runs until
    `finish` (the walk needs sample_draft in Python per position)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    managers = []
    for name in ("prefill_cudagraph_manager", "decode_cudagraph_manager"):
        manager = getattr(speculator, name, None)
        if manager is None or "dispatch" in getattr(manager, "__dict__", {}):
            continue
        real = type(manager).dispatch.__get__(manager)

        def dispatch(num_reqs: int, num_tokens: int, *args: Any,
                     _real: Any = real, **kwargs: Any) -> Any:
            desc = _real(num_reqs, num_tokens, *args, **kwargs)
            if desc.cg_mode != CUDAGraphMode.FULL:
                return desc  # eager, or piecewise (sample_draft outside)
            return BatchExecutionDescriptor(
                cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens,
                num_reqs=num_reqs,
                num_active_loras=getattr(desc, "num_active_loras", 0))

        manager.__dict__["dispatch"] = dispatch
        managers.append(manager)
    if managers:
        speculator.__dict__[_EAGER_ATTR] = managers
        t = speculator.__dict__.get(gd.TRACKER_ATTR)
        if t is not None:
            t.stats["v2_eager_steps"] = t.stats.get("v2_eager_steps", 0) + 1


def _make_sample_draft(original: Any) -> Any:
    def sample_draft(self: Any, hidden_states: Any, sample_src_positions: Any,
                     idx_mapping: Any, temperature: Any, seeds: Any,
                     draft_step: Any, draft_logits: Any, spec_step_idx: int = 0,
                     *args: Any, **kwargs: Any) -> Any:
        t = self.__dict__.get(gd.TRACKER_ATTR)
        if (t is None or t.rows is None or t.reason_off
                or draft_logits is not None):
            return original(self, hidden_states, sample_src_positions,
                            idx_mapping, temperature, seeds, draft_step,
                            draft_logits, spec_step_idx, *args, **kwargs)
        try:
            return _sample(t, self, hidden_states, idx_mapping, draft_step,
                           spec_step_idx)
        except Exception:  # noqa: BLE001 - drafting help must never fail a step
            gd.logger.warning("vllm_patch: grammar-aware drafting failed; "
                              "stock drafting", exc_info=True)
            t.reason_off = "internal error"
            finish(self)
            return original(self, hidden_states, sample_src_positions,
                            idx_mapping, temperature, seeds, draft_step,
                            draft_logits, spec_step_idx, *args, **kwargs)

    return sample_draft


def _sample(t: gd.Tracker, spec: Any, hidden_states: Any, idx_mapping: Any,
            draft_step: Any, spec_step_idx: int) -> Any:
    """One greedy draft position under the grammar (grammar_drafts._walk)."""
    t0 = time.thread_time_ns()
    pos = t.position
    t.position += 1
    k = int(getattr(spec, "num_speculative_steps", 1) or 1)
    logits = spec.compute_draft_logits(hidden_states, spec_step_idx)
    rows = [(i, sh) for i, (_, sh) in t.rows.items() if sh.walking]
    vocab = int(spec.vllm_config.model_config.get_vocab_size())
    if rows and hidden_states.shape[0] > max(i for i, _ in rows) \
            and logits.shape[-1] >= vocab:
        # The drafter's argmax is computed by the walk (none where every
        # row walks with top-k candidates: their first column).
        ids = gd._walk(t, logits, None, None, rows, pos, vocab, k)
    else:
        ids = logits.argmax(dim=-1)
    t.cost.charge(t0)
    spec._maybe_predict_acceptance(logits, idx_mapping, draft_step)
    if t.position >= k:
        finish(spec)
    return ids


def stats(worker: Any) -> dict[str, int]:
    """grammar_drafts.stats for a V2 worker (its drafter is the runner's
    `speculator`); for `LLM.collective_rpc(grammar_draft_stats)`."""
    runner = getattr(worker, "model_runner", worker)
    return gd.stats(getattr(runner, "speculator", None) or runner)


grammar_draft_stats = stats


def feature_status(settings: Any) -> list[dict[str, str]]:
    """The status line of grammar-aware drafting on Model Runner V2 for
    `vllm-patch status`."""
    from vllm_patch.patching import REGISTRY, State

    names = [n for n in REGISTRY.patches if n.startswith("v2-grammar-drafts-")]
    failed = [f"{n}: {REGISTRY.outcomes[n].state.value}" for n in names
              if n in REGISTRY.outcomes and REGISTRY.outcomes[n].state
              not in (State.APPLIED, State.NOT_APPLICABLE)]
    if settings.disable:
        status, why = "off", "VLLM_PATCH_DISABLE=1"
    elif not (settings.masked_drafts or settings.forced_drafts):
        status, why = "off", ("VLLM_PATCH_MASKED_DRAFTS=0 and "
                              "VLLM_PATCH_FORCED_DRAFTS=0")
    elif failed or not names:
        status, why = "not active", "; ".join(failed) or "not registered"
    else:
        status, why = "on", (
            "masked and forced drafts as above, for greedy drafting by its "
            "EAGLE / MTP and draft-model speculators; a step where some "
            "request drafts under its grammar runs the speculator's CUDA "
            "graphs eagerly; stock drafting with probabilistic draft "
            "sampling, local argmax reduction, draft watermarking, data "
            "parallelism, parallel drafters (DFlash) and ngram")
    return [{"feature": "Model Runner V2", "status": status, "reason": why}]


_TARGET = ("vllm.v1.worker.gpu.spec_decode.speculator:DraftModelSpeculator"
           ".sample_draft")
_WHY = ("speculative decoding loses most drafts on structured outputs: "
        "Model Runner V2's speculator proposes its unconstrained choice and "
        "the grammar rejects it at the first forbidden token (even a "
        "drafter identical to the target gets far fewer than k + 1 tokens "
        "per step)")
_HOW = ("greedy drafting by V2's EAGLE / MTP and draft-model speculators: "
        "per draft position, rows with a shadow grammar take the drafter's "
        "best token their grammar allows (masked drafts), the only token it "
        "allows (forced drafts), and the grammar's forced continuation "
        "fills the first positions; the chosen token is the next position's "
        "input. Batches with such rows run the speculator's CUDA graphs "
        "eagerly for that step. Other rows and speculators: stock")
_UPSTREAM = ("vLLM PR #45400 (forced tokens as drafts, Model Runner V2) and "
             "#47885 (grammar-aware draft sampling) are open")
_REMOVE = "vLLM's V2 speculators draft under the grammar themselves"

PATCHES: list[Patch] = [
    Patch(
        name="v2-grammar-drafts-sample-draft",
        guarantee="package",
        target=_TARGET,
        versions=("0.33",),
        signature=("self", "hidden_states", "sample_src_positions",
                   "idx_mapping", "temperature", "seeds", "draft_step",
                   "draft_logits", "spec_step_idx", "num_steps"),
        make=_make_sample_draft,
        why=_WHY, how=_HOW, upstream=_UPSTREAM, remove_when=_REMOVE,
    ),
    Patch(
        name="v2-grammar-drafts-sample-draft-0.32",
        guarantee="package",
        target=_TARGET,
        versions=("0.32",),
        signature=("self", "hidden_states", "sample_src_positions",
                   "idx_mapping", "temperature", "seeds", "draft_step",
                   "draft_logits", "spec_step_idx"),
        make=_make_sample_draft,
        why=_WHY, how=_HOW + " (vLLM 0.32's signature)",
        upstream=_UPSTREAM, remove_when=_REMOVE,
    ),
]


__all__ = ["after_sampled", "eligible", "feature_status", "finish",
           "grammar_draft_stats", "off",
           "record_requests", "stats"]
