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
forward position by position while drafting, and left there: the next
advance keeps the walked drafts the target committed (the same tokens, so
the same grammar state) and rolls back only the rest, so it is in step in
sync and async scheduling alike and an accepted draft is not accepted by
the grammar a second time.

xgrammar's shadows are advanced, tried and rolled back for the whole
batch at once (`BatchGrammarMatcher.batch_accept_token` /
`batch_rollback` on the matchers' handles: one C++ call per token column
or candidate rank instead of one per row); the other backends row by row
through vLLM's grammar API, except a guidance shadow's try of tokens
without the stop token: one llguidance call (`_llguidance_accepts`).

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
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Sequence

from vllm_patch.v1.spec_decode.forced_drafts import CONTEXT_TOKENS

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
    req_id: str = ""
    # xgrammar's GrammarMatcher under the grammar (the fast path: one C++
    # call per token, vLLM's wrapper bypassed for the shadow's whole life so
    # its counters never disagree); None: the backend-neutral vLLM API.
    matcher: Any = None
    # Tokens the shadow stands after, beyond the committed state: walked
    # while drafting, kept after the propose (not rolled back there) until
    # the next `advance`, which keeps what the target committed of them
    # and rolls back only the rest (most accepted drafts are then not
    # accepted by the grammar a second time).
    path: list[int] = field(default_factory=list)
    # Still walking in this step (False after the grammar ended or refused).
    walking: bool = True
    # First draft position of this step the walk changed (the cost model's
    # counterfactual: without the feature, nothing after it is accepted).
    changed_at: int | None = None
    # The last committed tokens (the forced continuation's context).
    tail: list[int] = field(default_factory=list)
    # This step's forced continuation (drafts 0..len-1; already walked).
    forced: list[int] = field(default_factory=list)
    # ... computed but not drafted (to be judged against the target's).
    probe: list[int] = field(default_factory=list)
    # xgrammar: the matcher's handle for the batched calls and its stop
    # tokens (its grammar ends exactly when it accepts one of them:
    # vLLM's matchers keep xgrammar's terminate_without_stop_token off).
    handle: Any = None
    stops: frozenset = frozenset()
    # The committed state has ended (the grammar took a stop token; kept by
    # `advance`, the only place the committed state moves).
    ended: bool = False

    @property
    def walked(self) -> int:
        return len(self.path)

    def __post_init__(self) -> None:
        if self.matcher is not None:
            self.handle = self.matcher._handle
            self.stops = frozenset(int(x) for x in self.matcher.stop_token_ids)


def _matcher_of(grammar: Any) -> Any:
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    return grammar.matcher if isinstance(grammar, XgrammarGrammar) else None


def _ended(sh: Shadow) -> bool:
    return sh.matcher.is_terminated() if sh.matcher is not None \
        else sh.grammar.is_terminated()


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _committed_ended(sh: Shadow) -> bool:
    """Has the shadow's committed state ended? (xgrammar: kept by
    `advance`; no call.)"""
    return sh.ended if sh.matcher is not None else sh.grammar.is_terminated()


def _ends_at(sh: Shadow, token: int) -> bool:
    """After the shadow accepted `token`: has its grammar ended? (xgrammar:
    only a stop token ends it, so other tokens need no call.)"""
    if sh.matcher is not None:
        return token in sh.stops and sh.matcher.is_terminated()
    return sh.grammar.is_terminated()


def _batch_api() -> Any:
    """xgrammar's batched matcher calls on raw handles (one C++ call for
    the batch; the Python wrapper's own per-call conversions cost more
    than the calls): None where this xgrammar lacks them."""
    global _BATCH
    if _BATCH is False:
        try:
            from xgrammar.base import _core

            api = _core.BatchGrammarMatcher
            _BATCH = api if hasattr(api, "batch_accept_token") \
                and hasattr(api, "batch_rollback") else None
        except Exception:  # noqa: BLE001 - an xgrammar without them
            _BATCH = None
    return _BATCH


_BATCH: Any = False


def _flags(array: Any, n: int, stats: dict | None = None) -> list[bool]:
    """The batched accept's n results as Python bools. Its result is a
    tvm-ffi Array, whose iteration costs a Python generator step and a
    foreign call per element (about 0.6 us: more than the accept itself):
    read in one call through its printed form, "(1, 0, ...)", checked
    element by element, else element by element (counted in `stats` as
    `xgr_flags_slow`, said once in the log)."""
    try:
        from tvm_ffi import container

        api = container._ffi_api
        text = api.ReprPrint(array)
        if text[:1] == "(" and text[-1:] == ")":
            items = text[1:-1].rstrip(",").split(", ")
            if len(items) == n and all(x in ("0", "1") for x in items):
                return [x == "1" for x in items]
        out = [bool(api.ArrayGetItem(array, i)) for i in range(n)]
    except Exception:  # noqa: BLE001 - another FFI: its own iteration
        out = [bool(x) for x in array]
    _slow_flags(stats)
    return out


_SLOW_FLAGS_SAID = False


def _slow_flags(stats: dict | None) -> None:
    global _SLOW_FLAGS_SAID
    if stats is not None:
        stats["xgr_flags_slow"] += 1
    if not _SLOW_FLAGS_SAID:
        _SLOW_FLAGS_SAID = True
        logger.info("vllm_patch: grammar-aware drafting reads xgrammar's "
                    "batched accept results element by element (this "
                    "xgrammar / tvm-ffi prints them differently): correct, "
                    "slower")


def _try_each(shadows: Sequence[Shadow], tokens: Sequence[int],
              stats: dict | None = None) -> list[bool]:
    """`_try(shadows[i], tokens[i])` for every i: xgrammar's shadows in one
    batched call, the others one by one. Same outcome as the loop: each
    shadow's try touches its own grammar only."""
    n = len(shadows)
    if n == 0:
        return []
    api = _batch_api() if n > 1 else None
    if api is None:
        return [_try(sh, tok) for sh, tok in zip(shadows, tokens)]
    fast = [j for j in range(n) if shadows[j].handle is not None]
    if fast and stats is not None:
        stats["xgr_batch_accept_calls"] += 1
        stats["xgr_batch_accept_rows"] += len(fast)
    if len(fast) == n:
        return _flags(api.batch_accept_token(
            [sh.handle for sh in shadows], list(tokens), False), n, stats)
    out = [False] * n
    if fast:
        got = _flags(api.batch_accept_token(
            [shadows[j].handle for j in fast], [tokens[j] for j in fast],
            False), len(fast), stats)
        for j, ok in zip(fast, got):
            out[j] = bool(ok)
    for j in range(n):
        if shadows[j].handle is None:
            out[j] = _try(shadows[j], tokens[j])
    return out


def _try_all_each(shadows: Sequence[Shadow],
                  tokens: Sequence[Sequence[int]],
                  stats: dict | None = None) -> list[bool]:
    """`_try_all(shadows[i], tokens[i])` for every i: xgrammar's shadows
    advance one column of tokens per batched call (a refusal rolls that
    shadow back to where it was), the others one by one."""
    out = [True] * len(shadows)
    api = _batch_api() if len(shadows) > 1 else None
    active = []
    for j, (sh, toks) in enumerate(zip(shadows, tokens)):
        if api is None or sh.handle is None:
            out[j] = _try_all(sh, list(toks))
        elif toks:
            active.append(j)
    depth = 0
    while active:
        if stats is not None:
            stats["xgr_batch_accept_calls"] += 1
            stats["xgr_batch_accept_rows"] += len(active)
        got = _flags(api.batch_accept_token(
            [shadows[j].handle for j in active],
            [tokens[j][depth] for j in active], False), len(active), stats)
        nxt = []
        for j, ok in zip(active, got):
            if not ok:
                out[j] = False
                if depth:
                    shadows[j].matcher.rollback(depth)
            elif depth + 1 < len(tokens[j]):
                nxt.append(j)
        active = nxt
        depth += 1
    return out


def _rollback_each(shadows: Sequence[Shadow],
                   keep: Sequence[int] | None = None,
                   stats: dict | None = None) -> None:
    """Every shadow back to its committed state plus the first `keep[i]`
    tokens of its path (none by default): xgrammar's in one batched call.
    As `_rollback`, vLLM's grammar object agrees with its matcher after it.
    """
    undo = [(sh, sh.walked - (keep[j] if keep is not None else 0))
            for j, sh in enumerate(shadows)]
    undo = [(sh, n) for sh, n in undo if n > 0]
    api = _batch_api()
    fast = [(sh, n) for sh, n in undo if sh.handle is not None] \
        if api is not None else []
    if len(fast) > 1:
        if stats is not None:
            stats["xgr_batch_rollback_calls"] += 1
            stats["xgr_batch_rollback_rows"] += len(fast)
        api.batch_rollback([sh.handle for sh, _ in fast],
                           [n for _, n in fast])
        for sh, n in fast:
            g = sh.grammar
            g.num_processed_tokens -= n
            # Before its end: it walked on after this state.
            g._is_terminated = False
            del sh.path[len(sh.path) - n:]
    else:
        fast = []
    done = {id(sh) for sh, _ in fast}
    for sh, n in undo:
        if id(sh) not in done:
            _rollback(sh, n)
            del sh.path[len(sh.path) - n:]


def _try(sh: Shadow, token: int) -> bool:
    """Advance the shadow by `token` if its grammar allows it there; a
    refusal changes nothing (and logs nothing)."""
    if sh.matcher is not None:
        return bool(sh.matcher.accept_token(token))
    return _accepts(sh.grammar, sh.req_id, [token])


def _try_all(sh: Shadow, tokens: list[int]) -> bool:
    """Advance by every token, or (refused) leave the shadow where it was."""
    if sh.matcher is None:
        return _accepts(sh.grammar, sh.req_id, tokens)
    for n, token in enumerate(tokens):
        if not sh.matcher.accept_token(token):
            if n:
                sh.matcher.rollback(n)
            return False
    return True


def _rollback(sh: Shadow, n: int) -> None:
    # Through vLLM's grammar also for xgrammar: its rollback re-reads the
    # matcher's termination (the forced continuation walks the wrapper).
    sh.grammar.rollback(n)


def _fill(t: "Tracker", shadows: list[Shadow], bitmask: Any) -> None:
    """Row r of `bitmask` = the tokens shadow r allows next: xgrammar's
    rows in one batched call (no Python per row, GIL released), the others
    through vLLM's grammar API."""
    fast = [r for r, sh in enumerate(shadows) if sh.matcher is not None]
    if len(fast) > 1:
        import xgrammar as xgr

        if t.batcher is None:
            t.batcher = xgr.BatchGrammarMatcher(max_threads=BATCH_THREADS)
        t.batcher.batch_fill_next_token_bitmask(
            [shadows[r].matcher for r in fast], bitmask, fast)
    elif fast:
        shadows[fast[0]].matcher.fill_next_token_bitmask(bitmask, fast[0])
    for r, sh in enumerate(shadows):
        if sh.matcher is None:
            sh.grammar.fill_bitmask(bitmask, r)


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
    # This step: batch row -> (req_id, shadow); None outside a propose call
    # and in a step the cost model keeps stock.
    rows: dict[int, tuple[str, Shadow]] | None = None
    batch_req_ids: list[str] = field(default_factory=list)
    position: int = 0
    k: int = 1
    # req_id -> number of drafts worth handing over (drafts after the
    # grammar's end are dropped).
    limits: dict[str, int] = field(default_factory=dict)
    # req_id -> first draft position the last walk changed (cost model).
    changed: dict[str, int] = field(default_factory=dict)
    # req_id -> the last walk's forced continuation (its tokens, drafted or
    # only computed to be judged) and the drafts handed over.
    last_walk: dict[str, tuple[list[int], bool, int]] = field(
        default_factory=dict)
    # Whether the forced continuation drafts ahead of the model's drafts
    # (draft_cost.ForcedAheadChoice), and this step's mode.
    forced_choice: Any = None
    # A one-row bitmask to time a verification row's fill (cost model).
    fill_scratch: Any = None
    forced_mode: str = "draft"
    # Masked-argmax tokens of the previous position still on the device
    # (shadows, tensor): read with this position's candidates, so a
    # position costs at most one device-to-host synchronisation.
    pending: tuple[list[Shadow], Any] | None = None
    batcher: Any = None
    cost: Any = None
    stats: dict[str, int] = field(default_factory=lambda: {
        "propose_calls": 0,
        # Draft positions of structured requests drafted under the grammar.
        "positions": 0,
        # ... where a bitmask was filled because the drafter's candidates
        # were all refused, and it allowed one token only (forced draft).
        "forced": 0,
        # ... of which the forced token replaced another drafter choice.
        "forced_changed": 0,
        # ... masked positions where the grammar changed the drafter's choice.
        "masked_changed": 0,
        # Bitmask rows filled (rows whose candidates were all refused), and
        # rows beyond the per-position budget (no draft from there on).
        "fallback_rows": 0,
        "fallback_capped": 0,
        # Requests whose drafting stopped at the grammar's end.
        "ended": 0,
        # Drafts dropped after the grammar's end.
        "drafts_trimmed": 0,
        # Shadows built / lost (out of step: stock drafting from then on).
        "shadows": 0,
        "shadows_lost": 0,
        # Device traffic the feature adds (bytes; synchronisations: reads
        # the host waits for).
        "h2d_bytes": 0,
        "d2h_bytes": 0,
        "d2h_syncs": 0,
        # Draft tokens accepted thanks to a changed draft (cost model).
        "gain_tokens": 0,
        # Drafts from the grammar's forced continuation (ahead of the
        # model's drafts), and how many of them the target accepted.
        "forced_ahead": 0,
        "forced_ahead_accepted": 0,
        # ... computed but not drafted, where the continuation yields to
        # the drafter (the target takes the drafter's spelling more often).
        "forced_probed": 0,
        # Thread CPU time of the tensor work the feature adds on the
        # logits' device (top-k, gathers, the masked argmax), ns: on a GPU
        # host that part runs on the GPU, not in the hooks' CPU time.
        "device_ns": 0,
        # xgrammar's batched matcher calls (advance, try and roll back
        # the batch's shadows in one C++ call each) and the rows they
        # took; results read element by element (the slow read).
        "xgr_batch_accept_calls": 0,
        "xgr_batch_accept_rows": 0,
        "xgr_batch_rollback_calls": 0,
        "xgr_batch_rollback_rows": 0,
        "xgr_flags_slow": 0,
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

    from vllm_patch.v1.spec_decode.draft_cost import (DraftCost,
                                                       ForcedAheadChoice)

    s = envs.settings()
    t = Tracker(masked=s.masked_drafts and not model_free,
                forced=s.forced_drafts)
    on_cpu = str(getattr(drafter, "device", "cpu")).startswith("cpu")
    t.cost = DraftCost(enabled=s.draft_cost_model,
                       sync_ns=0.0 if on_cpu else s.draft_sync_us * 1e3)
    # Model-free drafters (ngram, suffix decoding) always take the forced
    # continuation: no model whose spelling could be better.
    t.forced_choice = None if model_free else ForcedAheadChoice(
        enabled=s.draft_cost_model)
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

    if not isinstance(drafter, SpecDecodeBaseProposer):
        # Model Runner V2's speculators (their hooks: that module).
        from vllm_patch.v1.worker.gpu.spec_decode.speculator import eligible

        return eligible(drafter)
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


def wants_tokens(drafter: Any) -> bool:
    """The runner hook asks before it reads the step's sampled tokens (a
    device-to-host copy): False when the feature is off here or dormant."""
    t = tracker(drafter)
    return t is not None and not t.cost.dormant()


def advance(drafter: Any, requests: dict[str, Any], req_ids: Sequence[str],
            sampled: Sequence[Sequence[int]], skip: Sequence[bool],
            outputs_include_step: bool = False) -> None:
    """After a step: advance each structured request's shadow by the tokens
    the runner sampled for it (row i of `sampled`: -1 = rejected), building
    shadows for new requests (caught up with their earlier outputs).
    `skip[i]`: row i committed nothing (a partial prefill).
    `outputs_include_step`: the runner's bookkeeping already appended this
    step's tokens to the request state (drafting on CPU tokens).
    Also where the cost model learns what the last drafting step gained."""
    t = tracker(drafter)
    if t is None:
        return
    t0 = time.thread_time_ns()
    t.batch_req_ids = list(req_ids)
    live = set(requests)
    for req_id in [r for r in t.shadows if r not in live]:
        del t.shadows[req_id]
    t.lost &= live
    changed, t.changed = t.changed, {}
    last_walk, t.last_walk = t.last_walk, {}
    if last_walk and t.forced_choice is not None:
        t.forced_choice.tick()
    batch_requests = gain_tokens = 0
    # The walked requests' verification rows, and the rows stock would have
    # verified (its drafts cut at the first one the grammar refuses), each
    # weighted by the stock steps the request's step stood for (1 + its
    # speed-up): a request spends more stock steps where the walk helps,
    # which are also where stock verifies fewer rows.
    walk_rows = n_walked = 0
    stock_rows = stock_weight = 0.0
    # The walked requests' speed-ups: g / (t - g) each (draft_cost).
    gain = 0.0
    # The scheduler's verification rows of the last step (a lower bound:
    # one per structured request, plus the drafts the walk handed over).
    verify_rows = 0
    # Shadows to advance, and by what: all of them in batched calls below.
    todo: list[tuple[str, Shadow, list[int]]] = []
    for i, req_id in enumerate(req_ids):
        tokens = [x for x in map(int, sampled[i]) if x >= 0] \
            if i < len(sampled) else []
        batch_requests += bool(tokens)
        if req_id is None or (i < len(skip) and skip[i]):
            continue
        state = requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        if getattr(params, "structured_outputs", None) is None \
                or req_id in t.lost:
            continue
        tokens = _until_stop(params, tokens)
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
            shadow = t.shadows[req_id] = Shadow(grammar, req_id,
                                                _matcher_of(grammar))
            t.stats["shadows"] += 1
            tokens = earlier if outputs_include_step else earlier + tokens
        else:
            # Accepted drafts (the last token is the target's own) after
            # the first changed position: stock would have rejected there.
            accepted = max(0, len(tokens) - 1)
            walk = last_walk.get(req_id)
            verify_rows += 1 + (walk[2] if walk is not None else 0)
            speedup = 0.0
            if req_id in changed:
                g = max(0, accepted - changed[req_id])
                gain_tokens += g
                speedup = g / max(1, len(tokens) - g)
                gain += speedup
            if walk is not None:
                cut = changed.get(req_id, walk[2])
                walk_rows += 1 + walk[2]
                n_walked += 1
                stock_rows += (1 + speedup) * (1 + min(cut, walk[2]))
                stock_weight += 1 + speedup
                forced, drafted, drafts = walk
                if drafted:
                    t.stats["forced_ahead_accepted"] += min(accepted,
                                                            len(forced))
                if t.forced_choice is not None:
                    t.forced_choice.judge(forced, drafted, drafts, tokens)
        if tokens:
            todo.append((req_id, shadow, tokens))
    # A shadow whose grammar had ended takes no token: lost, as a refusal.
    ended = [e for e in todo if _committed_ended(e[1])]
    todo = [e for e in todo if not _committed_ended(e[1])]
    # Shadows that stand after the last walk: the committed tokens' common
    # prefix with the walked ones is kept (the same tokens, so the same
    # grammar state), the rest of the walk rolled back; only the tokens
    # after that prefix are accepted now.
    walked = [sh for _, sh, _ in todo if sh.path]
    keep = {id(sh): _common(sh.path, toks) for _, sh, toks in todo
            if sh.path}
    _rollback_each(walked, [keep[id(sh)] for sh in walked], t.stats)
    took = _try_all_each(
        [sh for _, sh, _ in todo],
        [x[keep.pop(id(sh), 0):] for _, sh, x in todo], t.stats)
    for sh in walked:
        sh.path = []
    for (req_id, shadow, tokens), ok in zip(todo, took):
        if ok:
            shadow.tail = (shadow.tail + tokens)[-CONTEXT_TOKENS:]
            shadow.ended = _ends_at(shadow, tokens[-1])
        else:
            ended.append((req_id, shadow, tokens))
    for req_id, _, _ in ended:
        del t.shadows[req_id]
        t.lost.add(req_id)
        t.stats["shadows_lost"] += 1
    t.stats["gain_tokens"] += gain_tokens
    extra_rows = max(0.0, walk_rows - n_walked * stock_rows / stock_weight) \
        if stock_weight else 0.0
    t.cost.observe(batch_requests, gain, extra_rows,
                   _verify_row_factor(t, verify_rows) if extra_rows else 1.0,
                   row_ns=_verify_row_ns(t) if extra_rows else None)
    t.cost.charge(t0, upkeep=True)
    t.cost.upkept(len(t.shadows))


def _until_stop(params: Any, tokens: list[int]) -> list[int]:
    """`tokens` up to and including the first one that ends the request
    (vLLM's `check_stop`: the request's EOS unless ignore_eos, or one of its
    stop_token_ids). The scheduler drops what a step sampled after it (a
    draft or the bonus token after an accepted stop token): the shadow must
    not take it either (its grammar has ended there and would refuse it:
    counted as a lost shadow, not as the end it is)."""
    eos = getattr(params, "eos_token_id", None)
    stops = getattr(params, "stop_token_ids", None) or ()
    for j, x in enumerate(tokens[:-1]):
        if x == eos or x in stops:
            return tokens[:j + 1]
    return tokens


def _accepts(grammar: Any, req_id: str, tokens: list[int]) -> bool:
    """Advance a vLLM grammar by `tokens` if it accepts them all.
    Checked first with validate_tokens (which advances nothing): a refusal
    is expected here (a shadow out of step, an unmasked draft), and
    xgrammar's accept_tokens logs it as an ERROR asking to file an issue.
    A guidance grammar and tokens without its stop token: one llguidance
    call instead of the two (`_guidance_accepts`)."""
    if tokens and _guidance_accepts is not None:
        got = _guidance_accepts(grammar, tokens)
        if got is not None:
            return got
    if len(grammar.validate_tokens(tokens)) != len(tokens):
        return False
    return grammar.accept_tokens(req_id, tokens)


def _llguidance_accepts(grammar: Any, tokens: list[int]) -> bool | None:
    """vLLM's GuidanceGrammar: validate_tokens then accept_tokens, as one
    `LLMatcher.try_consume_tokens` (it consumes the tokens the grammar
    takes, in order, and never puts the matcher in its error state), the
    part consumed of a refused list rolled back. Same outcome and the same
    matcher state as the two calls for tokens without the stop token (vLLM's
    accept_tokens then only consumes them; its validate_tokens refuses
    everything once the matcher stopped). It saves vLLM's Python around a
    second call, not the library's work (consuming a token, about 5 us at
    a 131k vocabulary, is the cost): 0.88x-0.96x of the drafting CPU at
    B=128. None: not such a grammar, or a list with the stop token (vLLM's
    own calls: its termination bookkeeping)."""
    matcher = getattr(grammar, "ll_matcher", None)
    if type(grammar).__name__ != "GuidanceGrammar" or matcher is None:
        return None
    if grammar.ll_tokenizer.eos_token in tokens or -1 in tokens:
        return None
    if matcher.is_stopped():
        return False
    n = matcher.try_consume_tokens(tokens)
    if n == len(tokens):
        return True
    if n:
        matcher.rollback(n)
    return False


def _has_try_consume() -> bool:
    try:
        import llguidance
    except ImportError:
        return False
    return hasattr(llguidance.LLMatcher, "try_consume_tokens")


_guidance_accepts = _llguidance_accepts if _has_try_consume() else None


def begin(drafter: Any, batch_size: int) -> None:
    """Start of drafter.propose: which rows draft under a grammar (none in
    a step the cost model keeps stock)."""
    t = tracker(drafter)
    if t is None:
        return
    t0 = time.thread_time_ns()
    t.stats["propose_calls"] += 1
    t.position = 0
    t.limits = {}
    t.pending = None
    rows: dict[int, tuple[str, Shadow]] = {}
    if len(t.batch_req_ids) == batch_size:
        # A walk the last advance did not settle (its request committed
        # nothing since): back to the committed state first.
        _rollback_each([sh for sh in map(t.shadows.get, t.batch_req_ids)
                        if sh is not None and sh.path], stats=t.stats)
        for i, req_id in enumerate(t.batch_req_ids):
            shadow = t.shadows.get(req_id)
            if shadow is not None:
                shadow.changed_at = None
                shadow.walking = not _committed_ended(shadow)
                if shadow.walking:
                    rows[i] = (req_id, shadow)
                else:
                    t.limits[req_id] = 0
    k = t.k = int(getattr(drafter, "num_speculative_tokens", 1) or 1)
    walk = t.cost.decide(len(rows), k) if rows else 0
    if walk < len(rows):
        # A sample walks (measuring, probing); the other rows draft as in
        # stock this step (no limits: their drafts are the drafter's).
        rows = dict(t.cost.sample(sorted(rows.items()), walk))
        if t.cost.regime == "dormant":
            t.lost |= set(t.shadows)
            t.shadows.clear()
    # The pass over the batch above (every shadow's state for the step, the
    # choice of a sample) is paid by every shadow, walking or not, off steps
    # included: upkeep, priced per shadow. Charged to the walk it was divided
    # over the 16 rows of a sampled step, B/16 times its share (measured at
    # a 131k vocabulary, B=256: 126 us a step, 8 us of the 211 us per row a
    # sample priced the walk at).
    t.cost.charge(t0, upkeep=True)
    t0 = time.thread_time_ns()
    for _, shadow in rows.values():
        shadow.forced = []
        shadow.probe = []
    t.forced_mode = "skip"
    if rows and t.forced:
        t.forced_mode = t.forced_choice.mode() if t.forced_choice else "draft"
        if t.forced_mode != "skip":
            _forced_ahead(t, rows, k, drafted=t.forced_mode == "draft")
    t.rows = rows or None
    t.cost.charge(t0)


def _forced_ahead(t: Tracker, rows: dict[int, tuple[str, Shadow]],
                  k: int, drafted: bool = True) -> None:
    """The grammar's forced continuation from the committed state, tokenized
    as the model's tokenizer does (vllm_patch.v1.spec_decode.forced_drafts):
    each request's first drafts, ahead of the model's (the shadow stands
    after them, walked); not `drafted`: only kept to be judged against
    what the target takes (the shadow is left where it was)."""
    from vllm_patch.v1.spec_decode.forced_drafts import forced_tokens

    manager = t.manager
    tokenizer = getattr(manager, "tokenizer", None) or getattr(
        getattr(manager, "backend", None), "tokenizer", None)
    if tokenizer is None:
        return
    for req_id, shadow in rows.values():
        forced = forced_tokens(shadow.grammar, shadow.tail, tokenizer, k,
                               keep_walked=drafted, request_id=req_id)
        if forced and not drafted:
            shadow.probe = forced
            t.stats["forced_probed"] += len(forced)
        elif forced:
            shadow.forced = forced
            shadow.path = list(forced)
            t.stats["forced_ahead"] += len(forced)


def end(drafter: Any) -> None:
    """End of drafter.propose (also on error): the walk's bookkeeping (the
    shadows keep the walked drafts until the next `advance`)."""
    t = drafter.__dict__.get(TRACKER_ATTR)
    if t is None or t.rows is None:
        return
    t0 = time.thread_time_ns()
    sample = t.cost.wants_fill_sample()
    # The shadows stay where the walk left them: the next advance keeps the
    # drafts the target accepted and rolls back the rest.
    for req_id, shadow in t.rows.values():
        if sample:
            _rollback_each([shadow])  # a verification row: committed state
            sample = not _time_row_fill(t, shadow)
        if shadow.changed_at is not None:
            t.changed[req_id] = shadow.changed_at
        t.last_walk[req_id] = (shadow.forced or shadow.probe,
                               bool(shadow.forced),
                               t.limits.get(req_id, t.k))
        shadow.forced = []
        shadow.probe = []
    t.rows = None
    t.pending = None
    t.batch_req_ids = []
    t.cost.charge(t0)


def _scheduler_manager(t: Tracker) -> Any:
    """The scheduler's structured-output manager, where this process holds
    it (the in-process executor); None otherwise (a multiprocess worker's
    own manager verifies nothing)."""
    if t.local_manager is not None or t.manager_ref is None:
        return None
    return t.manager_ref()


def _verify_row_ns(t: Tracker) -> float | None:
    """What a verification row cost the scheduler's engine thread on its
    last walks (`parallel_rows.row_ns`: the real walk, threads included),
    where this process holds the scheduler's manager; None elsewhere (the
    cost model then prices a row as a shadow's fill)."""
    manager = _scheduler_manager(t)
    if manager is None:
        return None
    from vllm_patch.v1.structured_output import parallel_rows

    try:
        return parallel_rows.row_ns(manager)
    except Exception:  # noqa: BLE001 - a price estimate, never a failure
        logger.debug("vllm_patch: the scheduler's row price not read",
                     exc_info=True)
        return None


def _verify_row_factor(t: Tracker, rows: int) -> float:
    """What a verification row the walk adds costs the scheduler's engine
    thread, as a share of a serial row fill: the scheduler's own measured
    ratio where it walks `rows` rows on vLLM's fill threads
    (`parallel_rows.row_factor`). Only with the in-process executor, whose
    scheduler's manager is in this process; a multiprocess worker's own
    manager is not the scheduler's (it verifies nothing and measures no
    walk), so there a row is priced as a serial fill: 1.0."""
    manager = _scheduler_manager(t)
    if manager is None:
        return 1.0
    from vllm_patch.v1.structured_output import parallel_rows

    try:
        return parallel_rows.row_factor(manager, rows)
    except Exception as exc:  # noqa: BLE001 - a price estimate, never a failure
        from vllm_patch.patching import _warn_once

        _warn_once("vllm_patch: grammar-aware drafting could not read the "
                   f"scheduler's threaded verification price ({exc!r}); it "
                   "prices the verification rows its drafts add as serial "
                   "fills (never cheaper than they are)")
        logger.debug("vllm_patch: threaded verification price not read",
                     exc_info=True)
        return 1.0


def _time_row_fill(t: Tracker, shadow: Shadow) -> bool:
    """The price of one verification row: per scheduled position the
    scheduler fills a row with the same grammar, vocabulary and vLLM call
    (the shadow is at the committed state), then accepts the draft there
    and, after the request's rows, rolls them back: a fill, an accept and
    a rollback of one token (the accept of the first token the row
    allows). Priced at the fill alone, a row at a 131k vocabulary read 25 us
    where the scheduler's walk cost 41 us a row. False: not measurable
    here."""
    import numpy as np

    try:
        if t.fill_scratch is None:
            t.fill_scratch = t.manager.backend.allocate_token_bitmask(1)
        grammar = shadow.grammar
        t0 = time.thread_time_ns()
        grammar.fill_bitmask(t.fill_scratch, 0)
        ns = time.thread_time_ns() - t0
        words = t.fill_scratch[0].numpy().view(np.uint32)
        hit = np.flatnonzero(words)
        if len(hit):
            w = int(hit[0])
            token = 32 * w + (int(words[w]) & -int(words[w])).bit_length() - 1
            t0 = time.thread_time_ns()
            if grammar.accept_tokens(shadow.req_id, [token]):
                grammar.rollback(1)
            ns += time.thread_time_ns() - t0
        t.cost.fill_sample(float(ns))
        return True
    except Exception:  # noqa: BLE001 - a price estimate, never a failure
        logger.debug("vllm_patch: verification row fill not timed",
                     exc_info=True)
        return False


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
    """Bool [rows, vocab] from int32 [rows, words] grammar bitmask words
    (for tests and tools; the drafting path never expands a bitmask)."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool()
    bits = bits.reshape(bitmask.shape[0], -1)
    if bits.shape[1] < vocab:
        pad = torch.zeros(bitmask.shape[0], vocab - bits.shape[1],
                          dtype=torch.bool, device=bitmask.device)
        bits = torch.cat([bits, pad], dim=1)
    return bits[:, :vocab]


# --------------------------------------------------------------------------
# One draft position.
#
# The drafter's logits stay where they are (the GPU on a GPU host). Per
# position, for the structured rows that still walk their grammar:
# 1. candidates: the drafter's own choice (stock's argmax, kept for every
#    row) and, with masked drafts, its next best tokens (top-CANDIDATES):
#    one small read to the host;
# 2. each row takes the first candidate its shadow accepts (a grammar
#    accept is one C++ call of about a microsecond whatever the vocabulary:
#    no bitmask is filled for it);
# 3. only rows that refuse every candidate get a bitmask (filled in one
#    batched call, at most FALLBACK_BYTES_PER_STEP of them per step): none
#    allowed, the grammar ended; one, the forced token (known on the host);
#    several (masked drafts), the argmax among them, computed on the device
#    with the bitmask applied in place (xgrammar's kernel) to those rows
#    only, and read with the next position's candidates;
# 4. the rows whose token changed are written back in one small copy.
# On a CPU device the candidates beyond the drafter's choice are only
# computed for the rows that refused it (reads cost nothing there, top-k
# over the vocabulary does).
# --------------------------------------------------------------------------

CANDIDATES = 8
# Budget of bitmask rows copied to the device per step (the fallback rows).
FALLBACK_BYTES_PER_STEP = 1 << 20
BATCH_THREADS = 1
# None: top-k candidates up front on an accelerator, lazily on the CPU;
# True / False forces one path (the cost benchmark models a GPU with it).
CANDIDATES_UPFRONT: bool | None = None


def _to_host(t: Tracker, tensor: Any) -> list:
    t.stats["d2h_syncs"] += 1
    t.stats["d2h_bytes"] += tensor.numel() * tensor.element_size()
    return tensor.tolist()


def _to_device(t: Tracker, values: list[int], device: Any) -> Any:
    import numpy as np
    import torch

    # Through numpy: a third of torch.tensor's time for a list of ints.
    out = torch.from_numpy(np.array(values, dtype=np.int64))
    t.stats["h2d_bytes"] += out.numel() * out.element_size()
    return out.to(device, non_blocking=True) if str(device) != "cpu" else out


def sample(drafter: Any, original: Any, hidden_states: Any,
           sampling_metadata: Any) -> Any:
    """`_sample_draft_tokens` under the grammar for this position."""
    t = drafter.__dict__.get(TRACKER_ATTR)
    if t is None or t.rows is None or t.reason_off:
        return original(drafter, hidden_states, sampling_metadata)
    t0 = time.thread_time_ns()
    pos = t.position
    t.position += 1
    rows = [(i, sh) for i, (_, sh) in t.rows.items() if sh.walking]
    if not rows or hidden_states.shape[0] <= max(i for i, _ in rows):
        t.cost.charge(t0)
        return original(drafter, hidden_states, sampling_metadata)
    probabilistic = (getattr(drafter, "_enable_probabilistic_draft_probs", False)
                     and not sampling_metadata.all_greedy)
    vocab_model = int(drafter.vllm_config.model_config.get_vocab_size())
    k = int(getattr(drafter, "num_speculative_tokens", 1) or 1)
    if probabilistic:
        if t.masked:
            logits = drafter.model.compute_logits(hidden_states)
            ids, probs = _sample_masked(t, drafter, logits, rows, pos,
                                        vocab_model, sampling_metadata)
            t.cost.charge(t0)
            return ids, probs
        ids, probs = original(drafter, hidden_states, sampling_metadata)
        _walk(t, None, ids, probs, rows, pos, vocab_model, k)
    else:
        logits = drafter.model.compute_logits(hidden_states)
        ids, probs = _walk(t, logits, None, None, rows, pos, vocab_model,
                           k), None
    t.cost.charge(t0)
    return ids, probs


def _walk(t: Tracker, logits: Any, ids: Any, probs: Any,
          rows: list[tuple[int, Shadow]], pos: int, vocab_model: int,
          k: int) -> Any:
    """Steps 1-4 above; `ids` (and `probs`, one-hot at a forced token) are
    changed in place, and returned. `ids` None: the drafter's argmax is
    computed here (when every row walks with top-k candidates, it is their
    first column: no argmax of its own). `logits` None: the drafter sampled
    (forced drafts only, no masking)."""
    import torch

    device = (ids if ids is not None else logits).device
    masked = t.masked and logits is not None
    m = min(CANDIDATES, vocab_model) if masked else 1
    upfront = CANDIDATES_UPFRONT if CANDIDATES_UPFRONT is not None \
        else device.type != "cpu"
    index = [i for i, _ in rows]
    # Every row of the batch, in order (a batch of structured requests):
    # no gather (on a GPU, a copy of the whole [rows, vocab] logits).
    n_batch = (ids if ids is not None else logits).shape[0]
    whole = len(index) == n_batch and index == list(range(len(index)))
    idx = None if whole else _to_device(t, index, device)
    from_candidates = ids is None and whole and upfront and m > 1
    if ids is None and not from_candidates:
        ids = logits.argmax(dim=-1)
    # Each walking row's token in `ids` is its first candidate (so only
    # the rows whose choice differs need writing back): not where the
    # top-k's first and the argmax may differ (a tie).
    exact = from_candidates or not (upfront and m > 1)
    # 1. candidates (and the previous position's masked argmax tokens).
    d0 = time.thread_time_ns()
    if upfront and m > 1:
        if whole:
            cand_dev = logits.topk(m, dim=-1).indices
        elif 2 * len(index) >= ids.shape[0]:
            # Most rows walk: the top-k of every row, then the walking
            # rows' [rows, m] candidates (each row's top-k is its own), not
            # a gather of their [rows, vocab] logits first.
            cand_dev = logits.topk(m, dim=-1).indices[idx]
        else:
            cand_dev = logits[idx].topk(m, dim=-1).indices
    else:
        cand_dev = (ids if whole else ids[idx]).unsqueeze(1)
    if from_candidates:
        ids = cand_dev[:, 0]
    t.stats["device_ns"] += time.thread_time_ns() - d0
    pending, t.pending = t.pending, None
    parts = [cand_dev.reshape(-1)]
    if pending is not None:
        parts.append(pending[1].reshape(-1))
    flat = _to_host(t, torch.cat(parts) if len(parts) > 1 else parts[0])
    width = cand_dev.shape[1]
    n = len(rows)
    firsts = flat[0:n * width:width]
    if pending is not None:
        shadows = pending[0]
        tokens = flat[n * width:]
        got = _try_each(shadows, tokens, t.stats)
        for sh, token, ok in zip(shadows, tokens, got):
            if not ok:
                sh.walking = False
                continue
            sh.path.append(token)
            if _ends_at(sh, token):
                sh.walking = False
                t.limits[sh.req_id] = pos
                t.stats["ended"] += 1
    # 2. the first candidate each shadow accepts (the rows' tries batched:
    # one call per candidate rank; each row tries its candidates in order).
    chosen: dict[int, int] = {}
    by_mask: set[int] = set()  # chosen among the drafter's next best
    stuck: set[int] = set()  # chosen, but the shadow did not advance
    ahead: set[int] = set()  # the forced continuation's draft (walked)
    tries: list[int] = []
    for r in range(n):
        sh = rows[r][1]
        if not sh.walking:
            continue
        if pos < len(sh.forced):
            chosen[r] = sh.forced[pos]
            ahead.add(r)
        else:
            tries.append(r)
    todo: list[int] = []
    for r, ok in zip(tries, _try_each([rows[r][1] for r in tries],
                                      [firsts[r] for r in tries], t.stats)):
        if ok:
            chosen[r] = firsts[r]
        else:
            todo.append(r)
    if todo and m > 1:
        if upfront:
            more = {r: flat[r * width:(r + 1) * width] for r in todo}
        else:
            d0 = time.thread_time_ns()
            top = logits[_to_device(t, [index[r] for r in todo],
                                    device)].topk(m, dim=-1).indices
            t.stats["device_ns"] += time.thread_time_ns() - d0
            more = dict(zip(todo, _to_host(t, top)))
        for c in range(1, m):
            if not todo:
                break
            tokens = [more[r][c] for r in todo]
            left = []
            for r, token, ok in zip(todo, tokens, _try_each(
                    [rows[r][1] for r in todo], tokens, t.stats)):
                if ok:
                    chosen[r] = token
                    by_mask.add(r)
                else:
                    left.append(r)
            todo = left
    # 3. a bitmask only for rows that refused every candidate.
    masked_rows: list[int] = []
    if todo:
        import numpy as np

        words = (vocab_model + 31) // 32
        cap = max(1, FALLBACK_BYTES_PER_STEP // (max(k, 1) * words * 4))
        if len(todo) > cap:
            for r in todo[cap:]:
                rows[r][1].walking = False  # the drafter's token stays
            t.stats["fallback_capped"] += len(todo) - cap
            todo = todo[:cap]
        t.stats["fallback_rows"] += len(todo)
        bitmask = torch.full((len(todo), words), -1, dtype=torch.int32)
        _fill(t, [rows[r][1] for r in todo], bitmask)
        words_np = bitmask.numpy().view(np.uint32)
        counts = np.bitwise_count(words_np).sum(axis=1)
        for j, r in enumerate(todo):
            sh = rows[r][1]
            if counts[j] == 0:
                sh.walking = False  # nothing allowed: ended
                t.limits[sh.req_id] = pos
                t.stats["ended"] += 1
            elif counts[j] == 1:
                t.stats["forced"] += 1
                w = int(np.flatnonzero(words_np[j])[0])
                token = 32 * w + int(words_np[j, w]).bit_length() - 1
                if t.forced:
                    # The only token the grammar allows is the draft, also
                    # where the shadow will not take it (guidance's stopped
                    # matcher allows EOS and accepts nothing): then the
                    # walk stops there.
                    chosen[r] = token
                    t.stats["forced_changed"] += 1
                    if not _try(sh, token):
                        stuck.add(r)
                else:
                    sh.walking = False
            elif masked:
                masked_rows.append(j)
            else:
                sh.walking = False  # the drafter left the grammar
        if masked_rows:
            _masked_argmax(t, logits, ids, bitmask, rows, todo, masked_rows,
                           index, pos, k, vocab_model, defer=upfront)
    # 4. write back the chosen tokens that differ from what `ids` holds
    # (all of them where it may hold another token: see `exact`), in one
    # copy to the device; count what changed.
    write = [r for r, token in chosen.items()
             if not exact or token != firsts[r]]
    if write:
        pair = _to_device(t, [index[r] for r in write]
                          + [chosen[r] for r in write], device)
        d0 = time.thread_time_ns()
        ids[pair[:len(write)]] = pair[len(write):].to(ids.dtype)
        t.stats["device_ns"] += time.thread_time_ns() - d0
    t.stats["positions"] += len(chosen)
    for r, token in chosen.items():
        sh = rows[r][1]
        if token != firsts[r]:
            if r in by_mask:
                t.stats["masked_changed"] += 1
            if sh.changed_at is None:
                sh.changed_at = pos
            if probs is not None:
                probs[index[r]] = 0.0
                probs[index[r], token] = 1.0
        if r in stuck:
            sh.walking = False
            continue
        if r in ahead:
            if pos + 1 < len(sh.forced):
                continue  # the shadow already stands after the continuation
        else:
            sh.path.append(token)
        if _ends_at(sh, token):
            sh.walking = False
            t.limits[sh.req_id] = pos + 1
            t.stats["ended"] += 1
    return ids


def _masked_argmax(t: Tracker, logits: Any, ids: Any, bitmask: Any,
                   rows: list[tuple[int, Shadow]], todo: list[int],
                   masked_rows: list[int], index: list[int], pos: int,
                   k: int, vocab_model: int, defer: bool) -> None:
    """The argmax of the drafter's logits among the tokens the grammar
    allows, for the rows listed, on the logits' device; written into `ids`.
    `defer` (the accelerator path): the tokens are read with the next
    position's candidates (one synchronisation per position), and after
    the last position not at all (nothing depends on them); else now."""
    import torch
    import xgrammar as xgr

    device = logits.device
    sel = [todo[j] for j in masked_rows]
    at = _to_device(t, [index[r] for r in sel], device)
    d0 = time.thread_time_ns()
    sub = logits[at].float()
    mask = bitmask[torch.tensor(masked_rows)]
    if device.type != "cpu":
        t.stats["h2d_bytes"] += mask.numel() * mask.element_size()
        mask = mask.pin_memory().to(device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(sub, mask, vocab_size=min(
        vocab_model, sub.shape[-1]))
    if sub.shape[-1] > vocab_model:
        sub[:, vocab_model:] = float("-inf")
    tokens = sub.argmax(dim=-1)
    ids[at] = tokens.to(ids.dtype)
    t.stats["device_ns"] += time.thread_time_ns() - d0
    shadows = [rows[r][1] for r in sel]
    t.stats["masked_changed"] += len(sel)
    t.stats["positions"] += len(sel)
    for sh in shadows:
        if sh.changed_at is None:
            sh.changed_at = pos
    if not defer:
        host = _to_host(t, tokens)
        got = _try_each(shadows, host, t.stats)
        for sh, token, ok in zip(shadows, host, got):
            if not ok:
                sh.walking = False
                continue
            sh.path.append(token)
            if _ends_at(sh, token):
                sh.walking = False
                t.limits[sh.req_id] = pos + 1
                t.stats["ended"] += 1
    else:
        t.pending = (shadows, tokens)  # end() drops it after the last one


def _sample_masked(t: Tracker, drafter: Any, logits: Any,
                   rows: list[tuple[int, Shadow]], pos: int, vocab_model: int,
                   sampling_metadata: Any) -> Any:
    """Probabilistic drafting: the structured rows' draft distribution is
    the masked, renormalised one (the rejection sampler needs the
    probabilities the draft was drawn from), so their bitmasks are filled
    and applied on the device before vLLM's own draft sampling."""
    import numpy as np
    import torch
    import xgrammar as xgr

    device = logits.device
    words = (vocab_model + 31) // 32
    bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
    _fill(t, [sh for _, sh in rows], bitmask)
    t.stats["fallback_rows"] += len(rows)
    counts = np.bitwise_count(bitmask.numpy().view(np.uint32)).sum(axis=1)
    index = [i for i, _ in rows]
    mask = bitmask
    if device.type != "cpu":
        t.stats["h2d_bytes"] += mask.numel() * mask.element_size()
        mask = mask.pin_memory().to(device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, mask, indices=index,
                                    vocab_size=min(vocab_model, logits.shape[-1]))
    if logits.shape[-1] > vocab_model:
        logits[_to_device(t, index, device), vocab_model:] = float("-inf")
    ids, probs = drafter._sample_from_logits(logits, sampling_metadata)
    chosen = _to_host(t, ids[_to_device(t, index, device)])
    for (i, sh), token, n in zip(rows, chosen, counts):
        t.stats["positions"] += 1
        if n == 0:
            sh.walking = False
            t.limits[sh.req_id] = pos
            t.stats["ended"] += 1
            continue
        if n == 1:
            t.stats["forced"] += 1
        if not _try(sh, int(token)):
            sh.walking = False
            continue
        sh.path.append(int(token))
        if _ended(sh):
            sh.walking = False
            t.limits[sh.req_id] = pos + 1
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
    if t is not None and t.cost is not None:
        out.update({f"cost_{k}": v for k, v in t.cost.snapshot().items()})
    if t is not None and t.forced_choice is not None:
        out.update({f"forced_ahead_{k}": v
                    for k, v in t.forced_choice.snapshot().items()})
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
    from vllm_patch.v1.spec_decode import draft_cost as dc

    any_on = any(r["status"] == "on" for r in rows)
    if not any_on:
        status, why = "off", "grammar-aware drafting is off"
    elif settings.draft_cost_model:
        status, why = "on", (
            "per batch and step: drafts under the grammar only while the "
            "measured gain in output speed (how much faster a walked "
            "request moves) exceeds "
            f"{dc.DECISION_MARGIN:g} times the measured cost in step time, "
            "relative to the step without the walk (host CPU time of the "
            "feature, the verification rows its drafts add + "
            f"{settings.draft_sync_us:g} us per device synchronisation on a "
            f"GPU); a batch of more than {dc.SAMPLE_ROWS} structured "
            "requests is measured and probed on a sample of them "
            f"({dc.SAMPLE_ROWS} and {dc.LARGE_SAMPLE_ROWS} rows in turn: a "
            "walk's fixed cost per step and its cost per row, told apart); "
            "off for "
            f"{dc.DORMANT_AFTER} steps in a row: dormant (no cost) and "
            f"re-armed for new requests after {dc.BACKOFF_FIRST}-"
            f"{dc.BACKOFF_MAX} steps; the live regime is in "
            "the worker's log and grammar_draft_stats")
    else:
        status, why = "off", ("VLLM_PATCH_DRAFT_COST_MODEL=0: every batch "
                              "drafts under the grammar, whatever it costs")
    rows.append({"feature": "drafting cost model", "status": status,
                 "reason": why})
    return rows
