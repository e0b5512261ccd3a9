"""Runtime invariant checker for the v1 scheduler (opt-in diagnostics).

`VLLM_PATCH_CHECK_INVARIANTS=1` applies `invariants-check` (every new
`Scheduler.__init__` instruments its scheduler) and per-object observers of
that scheduler's `update_from_output` and `_update_after_schedule` and of its
block pool's `free_blocks` (vllm_patch.v1.core.block_pool); after every
processed step it checks:

  computed_le_tokens  num_computed_tokens <= num_tokens (+ placeholders while
                      a step is in flight for the request)
  placeholders        num_output_placeholders >= 0, and 0 when nothing is in
                      flight for the request
  grammar_prefix      a structured request's committed output is accepted
                      by a SHADOW grammar (compiled afresh by the same
                      backend, fed only the committed tokens)
  post_terminal       no token is committed after the shadow grammar
                      terminated (only when grammar termination is a stop
                      condition: VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION != 0)
  grammar_sync        the request's grammar advanced exactly over the
                      committed tokens: same terminated flag as the shadow,
                      same next-token bitmask, and (xgrammar, outlines) the
                      same num_processed_tokens
  stop_complete       a structured request finished with "stop" has a
                      terminated shadow grammar (complete, grammar-valid),
                      unless the user's own stop token ended it;
                      with a reasoning parser, once the reasoning ended (a
                      stop inside the reasoning commits no structured
                      content: vLLM leaves the reasoning unconstrained)
  logprob_rows        logprob rows sent == tokens sent, per output
  finished_blocks     a finished request no longer in `requests` owns no
                      block in any KV manager (freed or moved to the
                      deferred-free list)
  idle_pool           when no request is left and nothing is in flight,
                      free blocks (+ deferred frees) == pool size - 1, and
                      no block still has a reference (ref_cnt == 0)
  double_free         a block is never freed more often than it was taken
                      (no free of a block whose ref_cnt is already 0);
                      with idle_pool: every block taken is freed exactly
                      once

Reasoning parsers: the shadow replays the request's reasoner over the
committed output (the grammar starts after the reasoning end, or at once
when the prompt ended the reasoning) and grammar_sync also checks that
`reasoning_ended` is latched exactly when a reasoning end was committed.
Not checked: parsers whose reasoning can end implicitly on a content token
(ParserEngineReasoningAdapter); grammars of backends other
than xgrammar / guidance / outlines (only the non-grammar invariants);
guidance exposes no token counter (bitmask + terminated flag only).

Steps outside the model runner's contract: a request scheduled with drafts
always gets at least one sampled token from a real runner (the target's own
token after the accepted drafts). A runner output that gives it none (vLLM's
own unit tests build such steps, e.g. test_spec_decoding_stats_empty_output)
leaves stock vLLM's counters inconsistent by itself: the drafts are never
un-counted, num_computed_tokens exceeds num_tokens, with or without the
patches. The checker judges the patches, not its inputs: from that step on
the request's own invariants are not checked (`Checker.unchecked` says why,
one warning line), so the checker can run raising inside vLLM's test suites
without failing a test stock passes; everything else stays checked.

On a violation: `InvariantViolation` (request id, invariant, state) when
`raise_on_violation()` is on (tests: `VLLM_PATCH_INVARIANTS_RAISE=1` or
`set_mode("raise")`); otherwise one error log line per request and invariant
and `vllm_patch_invariant_violations_total{invariant=...}` is incremented:
with stats logging on, the count rides on the step's `SchedulerStats` (field
added by `invariants-scheduler-stats-field`) to the frontend, whose
Prometheus logger counts it (`invariants-prometheus-record`), so /metrics
shows it also when the engine core is a separate process; without stats
logging, on this process's registry directly.
The fuzzer uses `set_mode("record", ...)` on one scheduler to collect all.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

from vllm_patch import patching as registry
from vllm_patch.patching import Patch

logger = logging.getLogger(__name__)

INVARIANTS = (
    "computed_le_tokens", "placeholders", "grammar_prefix", "post_terminal",
    "grammar_sync", "stop_complete", "logprob_rows", "finished_blocks",
    "idle_pool", "double_free",
)
CHECK_PATCH = "invariants-check"
_ATTR = "_vllm_patch_invariant_checker"


class InvariantViolation(AssertionError):
    def __init__(self, invariant: str, request_id: str | None,
                 detail: str, state: dict[str, Any]) -> None:
        self.invariant = invariant
        self.request_id = request_id
        self.detail = detail
        self.state = state
        super().__init__(f"invariant {invariant} violated for request "
                         f"{request_id}: {detail}; state={state}")


@dataclass
class Violation:
    invariant: str
    request_id: str | None
    detail: str
    state: dict[str, Any]


def _counter() -> Any:
    """vllm_patch_invariant_violations_total on prometheus_client's default
    REGISTRY of THIS process (vllm_patch.v1.metrics.loggers)."""
    from vllm_patch.v1.metrics.loggers import counter

    return counter()


def _stats_field_applied() -> bool:
    """The SchedulerStats field that carries the counts to the frontend is
    in place (invariants-scheduler-stats-field)."""
    try:
        from vllm.v1.metrics.stats import SchedulerStats

        from vllm_patch.v1.metrics.stats.invariants_field import INVARIANT_FIELD

        return INVARIANT_FIELD in SchedulerStats.__dataclass_fields__ and \
            INVARIANT_FIELD in SchedulerStats.__dict__
    except Exception:  # noqa: BLE001
        return False


def _env_raise() -> bool:
    from vllm_patch import envs

    return envs.settings().invariants_raise


def _post_terminal_applies() -> bool:
    from vllm_patch import envs

    return envs.settings().stop_on_grammar_termination


class _Shadow:
    """A fresh grammar of the same spec, fed only committed tokens."""

    __slots__ = ("grammar", "fed", "broken", "terminated", "backend",
                 "reasoning", "ids", "ended_at")

    def __init__(self, grammar: Any) -> None:
        self.grammar = grammar
        # None: not known yet; True: committed output still in the
        # reasoning (the grammar has not started); False: grammar active.
        self.reasoning: bool | None = None
        self.ids: list[int] = []      # prompt + reasoning tokens
        self.ended_at: int | None = None  # output tokens up to the end
        self.fed = 0
        self.broken = False
        self.terminated = False
        self.backend = type(grammar).__name__


def _bitmask(grammar: Any, vocab: int) -> Any:
    import torch

    bm = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    grammar.fill_bitmask(bm, 0)
    return bm


class Checker:
    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.mode = "raise" if _env_raise() else "serve"
        self.sink: Callable[[Violation], None] | None = None
        self.inflight: dict[str, int] = defaultdict(int)
        # tokens scheduled for the request in steps still in flight
        self.inflight_tokens: dict[str, int] = defaultdict(int)
        self.launched: dict[int, list[str]] = {}
        self.tracking = False
        self.watch: dict[str, Any] = {}
        self.shadows: dict[str, _Shadow | None] = {}
        # finished request -> (bound, num_computed_tokens) when first seen
        # finished
        self.finished_bound: dict[str, tuple[int, int]] = {}
        self.reported: set[tuple[str | None, str]] = set()
        # request -> why its invariants are no longer checked (a step
        # outside the model runner's contract; see the module docstring)
        self.unchecked: dict[str, str] = {}
        # serve mode: invariant -> violations not yet put on SchedulerStats
        self.pending_counts: dict[str, int] = defaultdict(int)
        self.checks = 0
        self.busy_update = False
        self.busy_track = False
        self.errored = False

    # ----------------------------------------------------------- violations
    def violate(self, invariant: str, req: Any, detail: str) -> None:
        rid = getattr(req, "request_id", None) if req is not None else None
        key = (rid, invariant)
        state = self.state(req) if req is not None else self.pool_state()
        if self.mode == "raise":
            raise InvariantViolation(invariant, rid, detail, state)
        if key in self.reported:
            return
        self.reported.add(key)
        if self.mode == "record":
            if self.sink is not None:
                self.sink(Violation(invariant, rid, detail, state))
            return
        logger.error("vllm_patch invariant %s violated for request %s: %s; "
                     "state=%s", invariant, rid, detail, state)
        if getattr(self.scheduler, "log_stats", False) and \
                _stats_field_applied():
            # To the frontend with the next SchedulerStats (the engine core
            # may be another process than the one serving /metrics).
            self.pending_counts[invariant] += 1
            return
        c = _counter()
        if c:
            c.labels(invariant=invariant).inc()

    def attach_counts(self, outputs: dict[int, Any]) -> None:
        """Move the counts not yet reported onto this step's SchedulerStats
        (vLLM attaches one per step when log_stats is on)."""
        if not self.pending_counts:
            return
        from vllm_patch.v1.metrics.stats.invariants_field import INVARIANT_FIELD

        for eco in outputs.values():
            stats = getattr(eco, "scheduler_stats", None)
            if stats is not None:
                mine = dict(getattr(stats, INVARIANT_FIELD, None) or {})
                for k, n in self.pending_counts.items():
                    mine[k] = mine.get(k, 0) + n
                setattr(stats, INVARIANT_FIELD, mine)
                self.pending_counts.clear()
                return

    def state(self, req: Any) -> dict[str, Any]:
        st: dict[str, Any] = {
            "status": getattr(req.status, "name", str(req.status)),
            "num_prompt_tokens": req.num_prompt_tokens,
            "num_tokens": req.num_tokens,
            "num_computed_tokens": req.num_computed_tokens,
            "num_output_placeholders": req.num_output_placeholders,
            "in_flight": self.inflight.get(req.request_id, 0),
            "output_token_ids": list(req.output_token_ids)[-16:],
            "spec_token_ids": list(req.spec_token_ids),
            "num_preemptions": getattr(req, "num_preemptions", None),
        }
        so_req = req.structured_output_request
        if so_req is not None:
            g = so_req.grammar
            st["grammar"] = type(g).__name__
            st["grammar_terminated"] = _safe(lambda: g.is_terminated())
            st["grammar_processed"] = getattr(g, "num_processed_tokens", None)
            sh = self.shadows.get(req.request_id)
            if sh is not None:
                st["shadow_fed"] = sh.fed
                st["shadow_terminated"] = sh.terminated
        return st

    def pool_state(self) -> dict[str, Any]:
        pool = self.scheduler.kv_cache_manager.block_pool
        return {"free": pool.get_num_free_blocks(),
                "size": pool.num_gpu_blocks - 1,
                "deferred": _deferred(self.scheduler),
                "requests": list(self.scheduler.requests)}

    # ------------------------------------------------------------ tracking
    def launched_step(self, scheduler_output: Any) -> None:
        self.tracking = True
        ids = dict(scheduler_output.num_scheduled_tokens)
        self.launched[id(scheduler_output)] = ids
        for rid, n in ids.items():
            self.inflight[rid] += 1
            self.inflight_tokens[rid] += n

    def applied_step(self, scheduler_output: Any) -> None:
        for rid, k in self.launched.pop(id(scheduler_output), {}).items():
            n = self.inflight.get(rid, 0) - 1
            if n > 0:
                self.inflight[rid] = n
                self.inflight_tokens[rid] -= k
            else:
                self.inflight.pop(rid, None)
                self.inflight_tokens.pop(rid, None)

    def runner_output(self, scheduler_output: Any, runner_output: Any) -> None:
        """Before the step is applied: requests scheduled with drafts that
        the runner gave no token (outside its contract, see the module
        docstring) leave the checked set."""
        spec = scheduler_output.scheduled_spec_decode_tokens
        if not spec:
            return
        index = runner_output.req_id_to_index
        sampled = runner_output.sampled_token_ids
        for rid, drafts in spec.items():
            i = index.get(rid)
            if not drafts or i is None or i >= len(sampled) or \
                    len(sampled[i]) or rid in self.unchecked:
                continue
            why = (f"the model runner returned no token for a step with "
                   f"{len(drafts)} draft(s) scheduled (a real runner always "
                   f"samples one); stock vLLM keeps the drafts counted")
            self.unchecked[rid] = why
            logger.warning("vllm_patch invariant checker: request %s: %s; "
                           "its invariants are not checked from now on",
                           rid, why)

    # -------------------------------------------------------------- checks
    def safe_after_update(self, scheduler_output: Any, before: dict[str, Any],
                          outputs: dict[int, Any]) -> None:
        """A checker error never breaks serving: only violations raise (in
        "raise" mode); an internal error is logged once and the step goes
        on (raised in "raise" mode, so tests see it)."""
        try:
            self.after_update(scheduler_output, before, outputs)
        except InvariantViolation:
            raise
        except Exception:  # noqa: BLE001
            if self.mode == "raise":
                raise
            if not self.errored:
                self.errored = True
                logger.exception("vllm_patch invariant checker failed; "
                                 "scheduling is unaffected")

    def after_update(self, scheduler_output: Any, before: dict[str, Any],
                     outputs: dict[int, Any]) -> None:
        self.checks += 1
        self.applied_step(scheduler_output)
        sched = self.scheduler
        self.watch.update(before)
        for eco in outputs.values():
            for o in eco.outputs:
                req = self.watch.get(o.request_id) or sched.requests.get(
                    o.request_id)
                if req is None or req.sampling_params is None:
                    continue
                if req.sampling_params.logprobs is None:
                    continue
                n = len(o.new_token_ids)
                rows = 0 if o.new_logprobs is None else \
                    len(o.new_logprobs.logprob_token_ids)
                if rows != n:
                    self.violate("logprob_rows", req,
                                 f"{rows} logprob rows for {n} tokens")
        for rid, req in list(self.watch.items()):
            if rid in self.unchecked:
                if req.is_finished() and rid not in sched.requests:
                    self.check_blocks(req)
            else:
                self.check_request(req)
            if req.is_finished() and rid not in sched.requests:
                self.watch.pop(rid, None)
                self.shadows.pop(rid, None)
                self.finished_bound.pop(rid, None)
                self.unchecked.pop(rid, None)
        self.check_idle()

    def check_request(self, req: Any) -> None:
        rid = req.request_id
        inflight = self.inflight.get(rid, 0) if self.tracking else None
        ph = req.num_output_placeholders
        if ph < 0:
            self.violate("placeholders", req, f"num_output_placeholders={ph}")
        elif inflight == 0 and ph != 0 and not req.is_finished():
            self.violate("placeholders", req,
                         f"num_output_placeholders={ph} with nothing in flight")
        # Steps in flight (async placeholders, or a sync batch queue) have
        # already counted their scheduled tokens as computed.
        if inflight is None:
            extra = max(ph, 0) + len(req.spec_token_ids)
        else:
            extra = self.inflight_tokens.get(rid, 0) if inflight else 0
        bound = req.num_tokens + extra
        # An abort freezes the counters of a request with steps in flight
        # (their outputs are dropped): not a committed state.
        aborted = req.status.name == "FINISHED_ABORTED"
        if req.is_finished() and not aborted:
            # A finished request that stays in `requests` (a KV connector
            # frees its blocks later) keeps the counters it had when it
            # finished; the outputs of steps then in flight are dropped.
            # Bound by the state at the finish, and nothing may grow later.
            first = self.finished_bound.setdefault(
                rid, (bound, req.num_computed_tokens))
            bound = first[0]
            if req.num_computed_tokens > first[1]:
                self.violate("computed_le_tokens", req,
                             f"num_computed_tokens={req.num_computed_tokens} "
                             f"grew after the finish (was {first[1]})")
        if req.num_computed_tokens > bound and not aborted:
            self.violate("computed_le_tokens", req,
                         f"num_computed_tokens={req.num_computed_tokens} > "
                         f"{bound}")
        if req.structured_output_request is not None:
            self.check_grammar(req)
        if req.is_finished() and rid not in self.scheduler.requests:
            self.check_blocks(req)

    def check_blocks(self, req: Any) -> None:
        held = _blocks_of(self.scheduler, req.request_id)
        if held:
            self.violate("finished_blocks", req,
                         f"finished and freed but owns {held} block(s)")

    def check_grammar(self, req: Any) -> None:
        rid = req.request_id
        so_req = req.structured_output_request
        mgr = self.scheduler.structured_output_manager
        reasoner = None
        if getattr(mgr, "reasoner_cls", None) is not None and \
                not getattr(mgr, "enable_in_reasoning", False):
            reasoner = mgr._get_reasoner(req)  # noqa: SLF001
            if reasoner is not None and \
                    type(reasoner).__name__ == "ParserEngineReasoningAdapter":
                return  # not checked: implicit (content) reasoning ends
        real = so_req.grammar
        if real is None or isinstance(real, Exception):
            return
        if type(real).__name__ not in ("XgrammarGrammar", "GuidanceGrammar",
                                       "OutlinesGrammar"):
            return
        if rid not in self.shadows:
            try:
                self.shadows[rid] = _Shadow(mgr._create_grammar(req))  # noqa: SLF001
            except Exception:  # noqa: BLE001
                self.shadows[rid] = None
        sh = self.shadows[rid]
        if sh is None:
            return
        out = req.output_token_ids
        if sh.reasoning is None:
            # The grammar starts after the reasoning end (unless the prompt
            # already ended the reasoning): replay the reasoner over the
            # committed output, as the manager does over accepted tokens.
            sh.ids = list(req.prompt_token_ids or [])
            sh.reasoning = reasoner is not None and \
                not reasoner.is_reasoning_end(sh.ids)
        eos = getattr(mgr.tokenizer, "eos_token_id", None)
        post_terminal = _post_terminal_applies()
        while sh.fed < len(out) and not sh.broken:
            t = out[sh.fed]
            sh.fed += 1
            if sh.reasoning:
                sh.ids.append(t)
                if reasoner.is_reasoning_end_streaming(sh.ids, [t]):
                    sh.reasoning = False
                    sh.ended_at = sh.fed
                continue
            if sh.terminated:
                if post_terminal:
                    self.violate("post_terminal", req,
                                 f"token {t} committed at output position "
                                 f"{sh.fed - 1}, after the grammar terminated")
                sh.broken = True
                break
            g = sh.grammar
            if sh.backend == "GuidanceGrammar" and g.ll_matcher.is_stopped():
                if t == eos:
                    g.accept_tokens(rid, [t])
                    sh.terminated = True
                    continue
                valid = []
            else:
                valid = g.validate_tokens([t])
            if not valid:
                if sh.backend == "OutlinesGrammar" and t == g.eos_token_id \
                        and g.guide.is_finished():
                    g.accept_tokens(rid, [t])
                    sh.terminated = g.is_terminated()
                    continue
                self.violate("grammar_prefix", req,
                             f"token {t} at output position {sh.fed - 1} is "
                             "not grammar-valid")
                sh.broken = True
                break
            g.accept_tokens(rid, [t])
            sh.terminated = bool(g.is_terminated())
        if sh.broken:
            return
        if sh.ended_at is not None and not so_req.reasoning_ended:
            self.violate("grammar_sync", req,
                         f"reasoning ended at output position "
                         f"{sh.ended_at - 1} but reasoning_ended="
                         f"{so_req.reasoning_ended}")
            return
        if sh.reasoning and so_req.reasoning_ended:
            self.violate("grammar_sync", req,
                         "reasoning_ended latched but no reasoning end "
                         "was committed")
            return
        # A stop inside the reasoning (EOS / stop token before the reasoning
        # end: vLLM leaves reasoning unconstrained) commits no structured
        # content at all; stop_complete applies once the grammar started.
        if req.is_finished() and req.status.name == "FINISHED_STOPPED" \
                and not sh.reasoning and not _complete(sh) \
                and not _user_stop(req):
            self.violate("stop_complete", req,
                         "finished with 'stop' but the grammar did not "
                         "terminate on the committed output")
        # grammar_sync: the request's grammar vs the shadow.
        try:
            rt = bool(real.is_terminated())
        except Exception:  # noqa: BLE001
            return
        if rt != sh.terminated:
            self.violate("grammar_sync", req,
                         f"grammar terminated={rt}, committed output "
                         f"terminates={sh.terminated}")
            return
        a = getattr(real, "num_processed_tokens", None)
        b = getattr(sh.grammar, "num_processed_tokens", None)
        if a is not None and b is not None and a != b:
            self.violate("grammar_sync", req,
                         f"grammar processed {a} tokens, committed {b}")
            return
        if not rt and not req.is_finished():
            vocab = getattr(real, "vocab_size", None) or len(mgr.tokenizer)
            ma, mb = _bitmask(real, vocab), _bitmask(sh.grammar, vocab)
            if not bool((ma == mb).all()):
                self.violate("grammar_sync", req,
                             "grammar's next-token mask differs from the "
                             "mask after the committed output")

    def check_idle(self) -> None:
        sched = self.scheduler
        if sched.requests or (self.tracking and self.inflight):
            return
        if self.tracking and self.launched:
            return
        pool = sched.kv_cache_manager.block_pool
        size = pool.num_gpu_blocks - 1
        free = pool.get_num_free_blocks() + _deferred(sched)
        if free != size:
            self.violate("idle_pool", None,
                         f"idle: {free} free (+deferred) blocks of {size}")
            return
        if _deferred(sched):
            return
        held = [(b.block_id, b.ref_cnt) for b in pool.blocks
                if not b.is_null and b.ref_cnt != 0]
        if held:
            self.violate("idle_pool", None,
                         f"idle: blocks still referenced (id, ref_cnt): "
                         f"{held[:8]}")

    def freeing(self, blocks: list[Any]) -> None:
        times: dict[int, int] = defaultdict(int)
        bad = []
        for b in blocks:
            if getattr(b, "is_null", False):
                continue
            times[id(b)] += 1
            if b.ref_cnt < times[id(b)]:
                bad.append(b.block_id)
        if bad:
            self.violate("double_free", None,
                         f"block(s) {bad[:8]} freed with ref_cnt 0")


def _user_stop(req: Any) -> bool:
    """The request stopped at one of the user's own stop_token_ids, its
    last committed token: vLLM ends the output there wherever the grammar
    stands (guidance and outlines allow such a token inside a JSON string;
    xgrammar makes it one of the grammar's stop tokens, allowed only where
    the grammar may end). The user asked for that end: not an incomplete
    'stop' of the patches' making."""
    reason = getattr(req, "stop_reason", None)
    stops = getattr(req.sampling_params, "stop_token_ids", None) or ()
    out = req.output_token_ids
    return isinstance(reason, int) and not isinstance(reason, bool) \
        and reason in stops and len(out) > 0 and out[-1] == reason


def _complete(sh: _Shadow) -> bool:
    """The committed output is a complete grammar output: terminated, or
    the grammar accepts ending here (a user stop token stopped it)."""
    if sh.terminated:
        return True
    g = sh.grammar
    try:
        if sh.backend == "GuidanceGrammar":
            m = g.ll_matcher
            return bool(m.is_stopped() or m.is_accepting())
        if sh.backend == "OutlinesGrammar":
            return bool(g.guide.is_finished())
        if sh.backend == "XgrammarGrammar":
            return any(g.validate_tokens([int(t)])
                       for t in g.matcher.stop_token_ids)
    except Exception:  # noqa: BLE001
        return True
    return True


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return repr(exc)


def _deferred(sched: Any) -> int:
    d = getattr(sched, "deferred_frees", None)
    return sum(len(b) for _, b in d) if d else 0


def _blocks_of(sched: Any, rid: str) -> int:
    coord = sched.kv_cache_manager.coordinator
    n = 0
    for mgr in getattr(coord, "single_type_managers", ()):
        blocks = mgr.req_to_blocks.get(rid)
        if blocks:
            n += sum(1 for b in blocks if not getattr(b, "is_null", False))
    return n


def checker(scheduler: Any) -> Checker:
    c = scheduler.__dict__.get(_ATTR)
    if c is None:
        c = Checker(scheduler)
        scheduler.__dict__[_ATTR] = c
    return c


def set_mode(scheduler: Any, mode: str,
             sink: Callable[[Violation], None] | None = None) -> Checker:
    """mode: "raise" (tests), "record" (calls `sink`), "serve" (log+metric)."""
    c = checker(scheduler)
    c.mode = mode
    c.sink = sink
    return c


def _snapshot(self: Any, scheduler_output: Any) -> dict[str, Any]:
    reqs = self.requests
    return {rid: reqs[rid] for rid in scheduler_output.num_scheduled_tokens
            if rid in reqs}


# The checker observes a scheduler through per-instance wrappers of
# `update_from_output` and `_update_after_schedule` (instance attributes),
# never by wrapping those class attributes: the G1 patches own them, and a
# second class-level wrapper stacked on a G1 wrapper breaks the registry's
# one-wrapper-per-attribute model (register() after a revert re-wrapped G1
# on top of the checker: two G1 FIFO entries per step). Each wrapper looks
# the class method up at call time, so later class patches / reverts apply,
# and never runs twice for one call (re-entrancy guard).
UPDATE_OBSERVER = "invariants-observe-update"
LAUNCH_OBSERVER = "invariants-observe-launch"


def _update_wrapper(_original: Any, scheduler: Any) -> Any:
    def update_from_output(scheduler_output, model_runner_output):
        c = checker(scheduler)
        method = type(scheduler).update_from_output
        if c.busy_update:
            return method(scheduler, scheduler_output, model_runner_output)
        c.busy_update = True
        try:
            try:
                c.runner_output(scheduler_output, model_runner_output)
            except Exception:  # noqa: BLE001 - never break serving
                if c.mode == "raise":
                    raise
            before = _snapshot(scheduler, scheduler_output)
            outputs = method(scheduler, scheduler_output, model_runner_output)
        finally:
            c.busy_update = False
        try:
            c.safe_after_update(scheduler_output, before, outputs)
        finally:
            if c.pending_counts:
                try:
                    c.attach_counts(outputs)
                except Exception:  # noqa: BLE001 - never break serving
                    pass
        return outputs

    return update_from_output


def _track_wrapper(_original: Any, scheduler: Any) -> Any:
    def _update_after_schedule(scheduler_output):
        c = checker(scheduler)
        method = type(scheduler)._update_after_schedule  # noqa: SLF001
        if c.busy_track:
            return method(scheduler, scheduler_output)
        c.busy_track = True
        try:
            method(scheduler, scheduler_output)
        finally:
            c.busy_track = False
        c.launched_step(scheduler_output)

    return _update_after_schedule


def instrument(scheduler: Any, force: bool = True) -> Checker:
    """Check one scheduler instance through per-object registry patches
    (idempotent). `invariants-check` calls it at the end of every
    `Scheduler.__init__` (force=False: only the observers that applied);
    test tooling calls it directly, also in a stock run (force=True)."""
    c = checker(scheduler)
    registry.wrap_instance(UPDATE_OBSERVER, scheduler, scheduler, force=force)
    registry.wrap_instance(LAUNCH_OBSERVER, scheduler, scheduler, force=force)
    pool = getattr(getattr(scheduler, "kv_cache_manager", None),
                   "block_pool", None)
    if pool is not None:
        from vllm_patch.v1.core.block_pool import FREE_OBSERVER

        registry.wrap_instance(FREE_OBSERVER, pool, scheduler, pool, force=force)
    return c


def instrumented(scheduler: Any) -> bool:
    """Does `scheduler` carry the checker's step observer?"""
    observer = scheduler.__dict__.get("update_from_output")
    return getattr(observer, registry.NAME_ATTR, None) == UPDATE_OBSERVER


def _make_init(original: Any) -> Any:
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        instrument(self, force=False)

    return __init__


_SCHED = "vllm.v1.core.sched.scheduler:Scheduler."
# The record fields every invariant-checker patch shares.
DIAGNOSTICS = dict(
    guarantee="package",
    versions=("0.32", "0.33"),
    upstream="SGLang's scheduler invariant checker",
    remove_when="never: opt-in diagnostics",
    enabled=lambda s: s.check_invariants and not s.disable,
)

PATCHES: list[Patch] = [
    Patch(
        name=CHECK_PATCH,
        target=_SCHED + "__init__",
        signature=("self", "vllm_config", "kv_cache_config",
                   "structured_output_manager", "block_size",
                   "hash_block_size", "mm_registry", "include_finished_set",
                   "log_stats"),
        make=_make_init,
        why="catch scheduler/grammar/KV invariant violations at runtime "
            "(VLLM_PATCH_CHECK_INVARIANTS=1)",
        how="instrument every new scheduler (AsyncScheduler included) with "
            "instance wrappers: count the request ids of every launched step "
            "after _update_after_schedule; after every update_from_output "
            "check counters, placeholders, a shadow grammar over the "
            "committed output, logprob rows, blocks of finished requests "
            "and, at idle, the block pool",
        **DIAGNOSTICS,
    ),
    Patch(
        name=UPDATE_OBSERVER,
        target=_SCHED + "update_from_output",
        signature=("self", "scheduler_output", "model_runner_output"),
        make=_update_wrapper,
        per_instance=True,
        why="the checks run after every processed step",
        how="per scheduler object: call the class method (looked up at call "
            "time, so G1's class patch and its revert stay in charge), then "
            "check the invariants on the requests of the step",
        **DIAGNOSTICS,
    ),
    Patch(
        name=LAUNCH_OBSERVER,
        target=_SCHED + "_update_after_schedule",
        signature=("self", "scheduler_output"),
        make=_track_wrapper,
        per_instance=True,
        why="the checks need the steps launched and not yet processed",
        how="per scheduler object: after the class method, count the "
            "request ids of the launched step",
        **DIAGNOSTICS,
    ),
]
