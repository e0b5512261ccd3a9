"""Grammar-aware drafting for the V1 runner's EAGLE / draft-model drafters:
drafts of structured requests are chosen among the tokens their grammar
allows (masked drafts), and a draft position where the grammar allows exactly
one token gets that token (forced drafts).

Where the grammar state lives: one *shadow* grammar per structured request,
in the drafter (worker side). It is a NEW grammar object compiled by a
structured-output backend (`backend.compile_grammar`, the same
StructuredOutputGrammar API for xgrammar, guidance and outlines; whose
backend: below). The committed
grammar the scheduler owns is never touched (under async scheduling the
scheduler advances it on another thread). The shadow is advanced with the
tokens this runner sampled in each step (accepted drafts + bonus token; it
sees them in `prepare_next_token_ids_*`, right before it drafts), walked
forward position by position while drafting and rolled back after, so it
is in step in sync and async scheduling alike.

Whose backend compiles the shadow:
- In-process executor (the worker runs in the engine-core process, one
  worker): the scheduler's own StructuredOutputManager, found in MANAGERS
  (same tokenizer info, same compile cache: the second compile is cheap).
- Multiprocess workers (the OpenAI server's default even with one worker;
  TP > 1, PP, Ray): no scheduler next to the drafter, so each worker builds
  its OWN manager, lazily at its first structured request: vLLM's
  StructuredOutputManager class on the worker's vllm_config (the tokenizer
  from the model config, the vocabulary size from
  model_config.get_vocab_size(), the backend class chosen by vLLM's own
  `grammar_init` from the request's `structured_outputs._backend`, which
  the scheduler output carries to the worker by pickle; the configured
  `structured_outputs_config.backend` when it is missing and concrete).
  xgrammar, guidance and outlines; not lm-format-enforcer (not installed
  here, so never tested): with it the feature is off in the worker and the
  log says so. The price is a second compile of each structured request's
  grammar, in the worker, when the request first drafts.
- Tensor parallel > 1: every rank compiles its own shadows and drafts the
  same tokens. Each rank's drafter sees the same logits (vLLM's
  LogitsProcessor all-gathers the full-vocabulary logits on every rank,
  the platforms' default, and stock drafting already relies on every rank
  choosing the same draft from them; drafters with a local argmax
  reduction are not covered here), the same
  committed token ids (the sampled tokens every rank advances its shadow
  with are the same on all ranks, as vLLM's draft inputs require), and a
  grammar compiled deterministically from the same request parameters with
  the same tokenizer and backend: so the same mask, the same forced tokens
  and the same argmax (or the same seeded draw) on every rank. A shadow is
  built, kept or dropped by the same deterministic steps on every rank
  (a compile error or a refused token happens on all of them alike). Were
  they ever to differ, only draft quality would suffer: the scheduler
  takes the drafts of one rank and the target verifies them with the
  committed grammar on every rank (below).

Correctness does not depend on the shadow: a draft is only a proposal the
target verifies with the committed grammar's bitmask. V1's rejection
sampler keeps the target distribution for any deterministic drafts (greedy
drafting, vLLM's default `draft_sample_method`); with probabilistic drafting
the masked logits are what the draft is sampled from, so the draft
probabilities handed to the rejection sampler are the masked, renormalised
distribution the draft was really drawn from. A forced draft replaces the
drafter's choice only with draft probabilities one-hot at that token.
A shadow that rejects a token (out of step: e.g. a step the runner took
without calling the drafter's preparation) is dropped: that request drafts
as in stock from then on (counted as `shadows_lost`).
"""

from __future__ import annotations

import logging
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Sequence

logger = logging.getLogger(__name__)

# Structured-output managers alive in this process (filled by the patch of
# StructuredOutputManager.__init__): the worker finds the scheduler's backend
# here when it runs in the engine-core process.
MANAGERS: "weakref.WeakSet[Any]" = weakref.WeakSet()

TRACKER_ATTR = "_vllm_patch_grammar_drafts"

# Backends a multiprocess worker builds its own grammars with.
WORKER_LOCAL_BACKENDS = ("xgrammar", "guidance", "outlines")

WORKER_LOCAL = (
    "this worker does not run in the engine-core process (multiprocess "
    "workers: the OpenAI server, tensor or pipeline parallel, Ray): it "
    "compiles its own copy of each structured request's grammar")


def not_active_backend(name: str) -> str:
    return (f"the structured-output backend {name!r} is not supported in "
            "multiprocess workers (they compile their own grammars with "
            f"{', '.join(WORKER_LOCAL_BACKENDS)} only)")


def find_manager(vllm_config: Any) -> Any:
    """The scheduler's StructuredOutputManager in this process: the one
    built from the same vllm_config, else the only one alive, else None."""
    live = list(MANAGERS)
    for manager in live:
        if getattr(manager, "vllm_config", None) is vllm_config:
            return manager
    return live[0] if len(live) == 1 else None


@dataclass
class Shadow:
    grammar: Any
    # Tokens walked forward while drafting in this step (rolled back after).
    walked: int = 0
    # Still walking in this step (False after the grammar ended or refused).
    walking: bool = True


@dataclass
class Tracker:
    """Per drafter (one per worker): the shadows, this step's context and
    the counters."""

    masked: bool
    forced: bool
    # The scheduler's StructuredOutputManager (in-process executor; weak:
    # the scheduler owns it), or this worker's own (multiprocess workers).
    manager_ref: Any = None
    local_manager: Any = None
    reason_off: str = ""
    shadows: dict[str, Shadow] = field(default_factory=dict)
    # req_ids that lost their shadow (stock drafting from then on).
    lost: set[str] = field(default_factory=set)
    # This step: batch row -> (req_id, shadow); None outside a propose call.
    rows: dict[int, tuple[str, Shadow]] | None = None
    batch_req_ids: list[str] = field(default_factory=list)
    position: int = 0
    # req_id -> number of drafts worth handing over (drafts after the
    # grammar's end are dropped).
    limits: dict[str, int] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=lambda: {
        "propose_calls": 0,
        # Draft positions of structured requests drafted under the grammar.
        "positions": 0,
        # ... of which the grammar allowed one token only (forced draft).
        "forced": 0,
        # ... of which the forced token replaced another drafter choice.
        "forced_changed": 0,
        # ... masked positions where the mask changed the drafter's choice.
        "masked_changed": 0,
        # Requests whose drafting stopped at the grammar's end.
        "ended": 0,
        # Drafts dropped after the grammar's end.
        "drafts_trimmed": 0,
        # Shadows built / lost (out of step: stock drafting from then on).
        "shadows": 0,
        "shadows_lost": 0,
    })

    @property
    def manager(self) -> Any:
        if self.local_manager is not None:
            return self.local_manager
        return self.manager_ref() if self.manager_ref is not None else None


def tracker(drafter: Any, model_free: bool = False) -> Tracker | None:
    """The drafter's tracker, created on first use; None when both switches
    are off or the feature cannot run here (said once in the log).
    `model_free`: a drafter without a model (ngram, suffix decoding): no
    logits to mask, so only forced drafts apply (its hooks call this)."""
    t = drafter.__dict__.get(TRACKER_ATTR)
    if t is not None:
        return t if not t.reason_off else None
    from vllm_patch import envs

    s = envs.settings()
    t = Tracker(masked=s.masked_drafts and not model_free,
                forced=s.forced_drafts)
    drafter.__dict__[TRACKER_ATTR] = t
    if not (t.masked or t.forced):
        t.reason_off = "off by switch"
        return None
    config = getattr(drafter, "vllm_config", None)
    so = getattr(config, "structured_outputs_config", None)
    if getattr(so, "reasoning_parser", "") or "":
        t.reason_off = "a reasoning parser is configured"
    elif not (model_free or drafter_eligible(drafter)):
        t.reason_off = (f"drafter {type(drafter).__name__} is not a "
                        "single-token EAGLE / draft-model drafter")
    if t.reason_off:
        logger.info("vllm_patch: grammar-aware drafting is off in this "
                    "worker: %s", t.reason_off)
        return None
    return t


def _bind_manager(t: Tracker, drafter: Any) -> bool:
    """The scheduler's manager when this worker runs next to it (in-process
    executor). False: none here; the worker builds its own at its first
    shadow (`_worker_local_grammar`)."""
    if t.manager is not None:
        return True
    manager = find_manager(getattr(drafter, "vllm_config", None))
    # A manager without a backend is not the one that compiled this
    # request's grammar (the scheduler builds its backend before the request
    # reaches a worker): e.g. a copy inherited by a forked process.
    if manager is None or getattr(manager, "backend", None) is None:
        return False
    t.manager_ref = weakref.ref(manager)
    return True


def backend_name(params: Any, vllm_config: Any) -> str | None:
    """The backend vLLM's manager uses for this request: the one the
    frontend resolved into `structured_outputs._backend`; else the
    configured one when it names a backend ("auto" does not)."""
    name = getattr(getattr(params, "structured_outputs", None), "_backend", None)
    if not name:
        so_config = getattr(vllm_config, "structured_outputs_config", None)
        name = getattr(so_config, "backend", None)
        if name == "auto":
            name = None
    return name or None


def _worker_local_grammar(t: Tracker, drafter: Any, req_id: str,
                          params: Any) -> Any:
    """Multiprocess worker, first structured request: build this worker's
    own StructuredOutputManager (vLLM's class: its tokenizer, its backend
    choice in `grammar_init`) and return the request's shadow grammar from
    it. None: no shadow for this request; `t.reason_off` set: the feature
    is off in this worker (said in the log)."""
    config = drafter.vllm_config
    name = backend_name(params, config)
    if name is None:
        logger.debug("vllm_patch: no structured-output backend named for %s",
                     req_id)
        return None
    if name not in WORKER_LOCAL_BACKENDS:
        t.reason_off = not_active_backend(name)
        logger.warning("vllm_patch: grammar-aware drafting (forced and "
                       "masked drafts) is off in this worker: %s; structured "
                       "requests draft as in stock vLLM", t.reason_off)
        return None
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.structured_output.request import StructuredOutputRequest

    manager = StructuredOutputManager(config)
    # Not the scheduler's: keep it out of find_manager's set.
    MANAGERS.discard(manager)
    # The drafter needs the grammar in this step: compile in this thread.
    manager._use_async_grammar_compilation = False
    so = params.structured_outputs
    if getattr(so, "_backend", None) != name:
        import copy

        so = copy.copy(so)  # never change the request's own parameters
        so._backend = name
    probe = SimpleNamespace(
        request_id=req_id,
        sampling_params=SimpleNamespace(
            structured_outputs=so,
            all_stop_token_ids=params.all_stop_token_ids),
        structured_output_request=StructuredOutputRequest(params=so))
    try:
        manager.grammar_init(probe)
    except Exception as exc:  # noqa: BLE001 - drafting must never fail a step
        if manager.backend is None:
            t.reason_off = (f"this worker could not build its own {name} "
                            f"structured-output backend: {exc}")
            logger.warning("vllm_patch: grammar-aware drafting (forced and "
                           "masked drafts) is off in this worker: %s",
                           t.reason_off)
            return None
        t.local_manager = manager
        raise
    t.local_manager = manager
    logger.info("vllm_patch: grammar-aware drafting: %s (backend %s)",
                WORKER_LOCAL, name)
    grammar = probe.structured_output_request._grammar
    if isinstance(grammar, Future):
        grammar = grammar.result()
    if isinstance(grammar, Exception):
        raise grammar
    return grammar


def drafter_eligible(drafter: Any) -> bool:
    """Drafters whose draft tokens come from `_sample_draft_tokens` over the
    full target vocabulary, one row per request and position."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    return (isinstance(drafter, SpecDecodeBaseProposer)
            and type(drafter)._greedy_sample is SpecDecodeBaseProposer._greedy_sample
            and not getattr(drafter, "use_local_argmax_reduction", False)
            and not getattr(drafter, "use_heterogeneous_vocab", False)
            and not getattr(drafter, "parallel_drafting", False))


def _compile(t: Tracker, drafter: Any, req_id: str, params: Any) -> Any:
    """A new shadow grammar for the request: compiled by the scheduler's
    backend in-process, by this worker's own backend otherwise."""
    from vllm.v1.structured_output.request import get_structured_output_key

    if not _bind_manager(t, drafter):
        return _worker_local_grammar(t, drafter, req_id, params)
    backend = getattr(t.manager, "backend", None)
    if backend is None:
        return None
    request_type, spec = get_structured_output_key(params.structured_outputs)
    return backend.compile_grammar(request_type, spec,
                                   stop_token_ids=params.all_stop_token_ids)


def advance(drafter: Any, requests: dict[str, Any], req_ids: Sequence[str],
            sampled: Sequence[Sequence[int]], skip: Sequence[bool],
            outputs_include_step: bool = False) -> None:
    """After a step: advance each structured request's shadow by the tokens
    the runner sampled for it (row i of `sampled`: -1 = rejected), building
    shadows for new requests (caught up with their earlier outputs).
    `skip[i]`: row i committed nothing (a partial prefill).
    `outputs_include_step`: the runner's bookkeeping already appended this
    step's tokens to the request state (drafting on CPU tokens)."""
    t = tracker(drafter)
    if t is None:
        return
    t.batch_req_ids = list(req_ids)
    live = set(requests)
    for req_id in [r for r in t.shadows if r not in live]:
        del t.shadows[req_id]
    t.lost &= live
    for i, req_id in enumerate(req_ids):
        if req_id is None or (i < len(skip) and skip[i]):
            continue
        state = requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        if getattr(params, "structured_outputs", None) is None \
                or req_id in t.lost:
            continue
        tokens = [int(x) for x in sampled[i] if int(x) >= 0] \
            if i < len(sampled) else []
        shadow = t.shadows.get(req_id)
        if shadow is None:
            earlier = list(getattr(state, "output_token_ids", ()))
            if any(x < 0 for x in earlier):
                t.lost.add(req_id)  # history unknown here: stock drafting
                continue
            try:
                grammar = _compile(t, drafter, req_id, params)
            except Exception:  # noqa: BLE001 - drafting must never fail a step
                logger.debug("vllm_patch: shadow grammar for %s failed to "
                             "compile", req_id, exc_info=True)
                grammar = None
            if t.reason_off:
                return
            if grammar is None:
                t.lost.add(req_id)
                continue
            shadow = t.shadows[req_id] = Shadow(grammar)
            t.stats["shadows"] += 1
            tokens = earlier if outputs_include_step else earlier + tokens
        if tokens and (shadow.grammar.is_terminated()
                       or not _accepts(shadow.grammar, req_id, tokens)):
            del t.shadows[req_id]
            t.lost.add(req_id)
            t.stats["shadows_lost"] += 1


def _accepts(grammar: Any, req_id: str, tokens: list[int]) -> bool:
    """Advance a shadow by `tokens` if its grammar accepts them all.
    Checked first with validate_tokens (which advances nothing): a refusal
    is expected here (a shadow out of step, an unmasked draft), and
    xgrammar's accept_tokens logs it as an ERROR asking to file an issue."""
    if len(grammar.validate_tokens(tokens)) != len(tokens):
        return False
    return grammar.accept_tokens(req_id, tokens)


def begin(drafter: Any, batch_size: int) -> None:
    """Start of drafter.propose: which rows draft under a grammar."""
    t = tracker(drafter)
    if t is None:
        return
    t.stats["propose_calls"] += 1
    t.position = 0
    t.limits = {}
    rows: dict[int, tuple[str, Shadow]] = {}
    if len(t.batch_req_ids) == batch_size:
        for i, req_id in enumerate(t.batch_req_ids):
            shadow = t.shadows.get(req_id)
            if shadow is not None:
                shadow.walked = 0
                shadow.walking = not shadow.grammar.is_terminated()
                if shadow.walking:
                    rows[i] = (req_id, shadow)
                else:
                    t.limits[req_id] = 0
    t.rows = rows or None


def end(drafter: Any) -> None:
    """End of drafter.propose (also on error): roll every shadow back to
    the committed state."""
    t = drafter.__dict__.get(TRACKER_ATTR)
    if t is None or t.rows is None:
        return
    for _, shadow in t.rows.values():
        if shadow.walked:
            shadow.grammar.rollback(shadow.walked)
        shadow.walked = 0
    t.rows = None
    t.batch_req_ids = []


def take_limits(drafter: Any) -> dict[str, int]:
    """Drafts worth handing over per request (after the grammar's end none
    are); consumed by the runner's take_draft_token_ids."""
    t = drafter.__dict__.get(TRACKER_ATTR) if drafter is not None else None
    if t is None or not t.limits:
        return {}
    limits, t.limits = t.limits, {}
    return limits


def trim_drafts(out: Any, limits: dict[str, int], stats: dict | None = None) -> Any:
    if out is None or not limits:
        return out
    trimmed = []
    for req_id, ids in zip(out.req_ids, out.draft_token_ids):
        n = limits.get(req_id)
        ids = list(ids)
        if n is not None and n < len(ids):
            if stats is not None:
                stats["drafts_trimmed"] += len(ids) - n
            ids = ids[:n]
        trimmed.append(ids)
    out.draft_token_ids = trimmed
    return out


def allowed_mask(bitmask: Any, vocab: int) -> Any:
    """Bool [rows, vocab] from int32 [rows, words] grammar bitmask words."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool()
    bits = bits.reshape(bitmask.shape[0], -1)
    if bits.shape[1] < vocab:
        pad = torch.zeros(bitmask.shape[0], vocab - bits.shape[1],
                          dtype=torch.bool, device=bitmask.device)
        bits = torch.cat([bits, pad], dim=1)
    return bits[:, :vocab]


def sample(drafter: Any, original: Any, hidden_states: Any,
           sampling_metadata: Any) -> Any:
    """`_sample_draft_tokens` under the grammar for this position."""
    import torch

    t = drafter.__dict__.get(TRACKER_ATTR)
    if t is None or t.rows is None or t.reason_off:
        return original(drafter, hidden_states, sampling_metadata)
    pos = t.position
    t.position += 1
    rows = [(i, req_id, sh) for i, (req_id, sh) in t.rows.items() if sh.walking]
    if not rows or hidden_states.shape[0] <= max(i for i, _, _ in rows):
        return original(drafter, hidden_states, sampling_metadata)
    index = [i for i, _, _ in rows]
    # Bitmask words as the scheduler allocates them (model vocabulary).
    vocab_model = int(drafter.vllm_config.model_config.get_vocab_size())
    words = (vocab_model + 31) // 32
    masks = torch.full((len(rows), words), -1, dtype=torch.int32)
    for r, (_, _, sh) in enumerate(rows):
        sh.grammar.fill_bitmask(masks, r)
    probabilistic = (getattr(drafter, "_enable_probabilistic_draft_probs", False)
                     and not sampling_metadata.all_greedy)
    if t.masked:
        logits = drafter.model.compute_logits(hidden_states)
        vocab = logits.shape[-1]
        allowed = allowed_mask(masks, vocab).to(logits.device)
        idx = torch.tensor(index, device=logits.device)
        before = logits[idx].argmax(dim=-1)
        sub = logits[idx].masked_fill(~allowed, float("-inf"))
        logits[idx] = sub
        if probabilistic:
            ids, probs = drafter._sample_from_logits(logits, sampling_metadata)
        else:
            ids, probs = logits.argmax(dim=-1), None
        chosen = ids[idx].tolist()
        t.stats["masked_changed"] += sum(
            int(a != b) for a, b in zip(before.tolist(), chosen))
        counts = allowed.sum(dim=-1).tolist()
    else:
        ids, probs = original(drafter, hidden_states, sampling_metadata)
        allowed = allowed_mask(masks, vocab_model)
        counts = allowed.sum(dim=-1).tolist()
        chosen = ids[torch.tensor(index, device=ids.device)].tolist()
    for r, (i, req_id, sh) in enumerate(rows):
        t.stats["positions"] += 1
        token = int(chosen[r])
        if counts[r] == 1:
            t.stats["forced"] += 1
            forced = int(allowed[r].nonzero()[0, 0])
            if t.forced and forced != token:
                t.stats["forced_changed"] += 1
                ids[i] = forced
                if probs is not None:
                    probs[i].zero_()
                    probs[i, forced] = 1.0
                token = forced
        elif counts[r] == 0:
            # Nothing allowed (ended): no draft from here on.
            sh.walking = False
            t.limits[req_id] = pos
            t.stats["ended"] += 1
            continue
        if not _accepts(sh.grammar, req_id, [token]):
            sh.walking = False  # unmasked drafter left the grammar
            continue
        sh.walked += 1
        if sh.grammar.is_terminated():
            sh.walking = False
            t.limits[req_id] = pos + 1
            t.stats["ended"] += 1
    return ids, probs


def stats(worker: Any) -> dict[str, int]:
    """The grammar-aware drafting counters of a worker's drafter; for
    `LLM.collective_rpc(grammar_draft_stats)`."""
    runner = getattr(worker, "model_runner", worker)
    drafter = getattr(runner, "drafter", runner)
    t = drafter.__dict__.get(TRACKER_ATTR) if drafter is not None else None
    out = dict(Tracker(False, False).stats if t is None else t.stats)
    out["active"] = int(t is not None and not t.reason_off)
    # 1: this worker compiles its own grammars (multiprocess workers).
    out["worker_local"] = int(t is not None and t.local_manager is not None)
    return out


grammar_draft_stats = stats


def feature_status(settings: Any) -> list[dict[str, str]]:
    """One status line per feature for `vllm-patch status`."""
    from vllm_patch.patching import REGISTRY, State

    names = [n for n in REGISTRY.patches if n.startswith("grammar-drafts-")]
    rows = []
    for feature, on, var in (
            ("forced drafts", settings.forced_drafts, "VLLM_PATCH_FORCED_DRAFTS"),
            ("masked drafts", settings.masked_drafts, "VLLM_PATCH_MASKED_DRAFTS")):
        # Forced drafts for drafters without a model are one patch of their
        # own: masked drafts do not need it.
        mine = [n for n in names if feature == "forced drafts"
                or n != "grammar-drafts-forced-model-free"]
        failed = [f"{n}: {REGISTRY.outcomes[n].state.value}"
                  for n in mine if n in REGISTRY.outcomes
                  and REGISTRY.outcomes[n].state is not State.APPLIED]
        drafters = ("with EAGLE / draft-model drafters (a position where the "
                    "grammar allows one token), ngram and suffix decoding "
                    "(the grammar's forced continuation, tokenized as the "
                    "model's tokenizer does, then the drafter's own drafts; "
                    "xgrammar and guidance: outlines has no forced text)"
                    if feature == "forced drafts"
                    else "with EAGLE / draft-model drafters")
        if settings.disable:
            status, why = "off", "VLLM_PATCH_DISABLE=1"
        elif not on:
            status, why = "off", f"{var}=0"
        elif failed or not mine:
            status, why = "not active", "; ".join(failed) or "not registered"
        else:
            status, why = "on", (
                f"{drafters}; in-process worker: the "
                "scheduler's grammars; multiprocess workers (the OpenAI "
                "server): worker-local grammars, xgrammar, guidance or "
                "outlines, off with lm-format-enforcer; off with a "
                "reasoning parser")
        rows.append({"feature": feature, "status": status, "reason": why})
    return rows
