"""G1 conformance scenarios: grammar state is current when it is used.

Each scenario drives the real scheduler through the engine-loop emulation of
`vllm_patch.testing.harness` (`engine_setup` / `engine_step`: EngineCore's
`step` or `step_with_batch_queue` with a queue of in-flight scheduler
outputs; the fake worker samples from the bitmask rows it is given, when
EngineCore calls `sample_tokens`). Every bitmask row and every validated
draft list is checked against a reference: a fresh copy of the request's
grammar advanced by everything the worker had for the request when the step
was launched (all earlier launched steps applied). [] means G1 holds.

The fake model wants "abab..." (grammar `(ab)+`): at an even output length
it prefers `a`, else `b`, and takes the first of a/b the row allows. The
fake drafter always proposes `a b a`, valid in one phase only, so a draft
list validated one token late differs from the reference. Violations name
tiny-tokenizer ids (a 70, b 71).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_patch.conformance import Scenario

REGEX = "(ab)+"


def harness(**kw: Any):
    """An xgrammar scheduler harness (no drafts unless `num_spec_tokens`)."""
    from vllm_patch.testing.harness import Harness

    kw.setdefault("num_spec_tokens", 0)
    return Harness("xgrammar", **kw)


def _allows(row: np.ndarray, tok: int) -> bool:
    bits = np.ascontiguousarray(row).view(np.uint32)
    return bool((int(bits[tok >> 5]) >> (tok & 31)) & 1)


def _pick(h, row, want: int) -> int:
    if row is None or _allows(row, want):
        return want
    for t in (h.tok("a"), h.tok("b")):
        if _allows(row, t):
            return t
    bits = np.unpackbits(np.ascontiguousarray(row).view(np.uint8),
                         bitorder="little")
    nz = np.flatnonzero(bits)
    return int(nz[0]) if nz.size else want


def sampler(h, rid: str, ctx: list[int], rows, spec: list[int]) -> list[int]:
    """Greedy 'abab' model with rejection sampling over `spec`."""
    req = h.scheduler.requests.get(rid)
    if req is None or not req.use_structured_output:
        return [h.tok("x")]
    a, b = h.tok("a"), h.tok("b")
    out: list[int] = []
    for i in range(len(spec) + 1):
        want = a if (len(ctx) + len(out)) % 2 == 0 else b
        row = rows[i] if rows is not None and i < len(rows) else None
        pick = _pick(h, row, want)
        if i < len(spec) and spec[i] == pick:
            out.append(pick)
            continue
        out.append(pick)
        break
    return out


def drafter(h, rid: str, ctx: list[int]) -> list[int]:
    a, b = h.tok("a"), h.tok("b")
    return [a, b, a][:h.num_spec_tokens]


class Reference:
    """Fresh grammars per request, advanced from scratch for each check."""

    def __init__(self, h) -> None:
        self.h = h
        self.grammars: dict[str, Any] = {}
        mgr = h.structured_output_manager
        self.bitmask = mgr.backend.allocate_token_bitmask(1)

    def add(self, rid: str) -> None:
        self.grammars[rid] = self.h.structured_output_manager._create_grammar(  # noqa: SLF001
            self.h.request(rid))

    def grammar(self, rid: str):
        g = self.grammars[rid]
        g.reset()
        return g

    def rows(self, rid: str, ctx: list[int], spec: list[int]):
        """Reference rows for positions 0..len(spec) (stops after the first
        -1 or grammar-invalid draft), or None if ctx is not grammar-valid."""
        g = self.grammar(rid)
        if ctx and not g.accept_tokens(rid, list(ctx)):
            return None
        rows = []
        for i in range(len(spec) + 1):
            if g.is_terminated():
                break
            g.fill_bitmask(self.bitmask, 0)
            rows.append(self.bitmask[0].numpy().copy())
            if i == len(spec) or spec[i] < 0 or not g.accept_tokens(rid, [spec[i]]):
                break
        return rows

    def validate(self, rid: str, ctx: list[int], drafts: list[int]):
        g = self.grammar(rid)
        if ctx and not g.accept_tokens(rid, list(ctx)):
            return None
        return list(g.validate_tokens(list(drafts)))


def check(h, rids: list[str]) -> list[str]:
    """Every bitmask row / validated draft list of `rids` vs the reference."""
    ref = reference(h)
    v: list[str] = []
    for n, rec in enumerate(h.steps):
        for rid, rows in (rec.bitmask_rows or {}).items():
            if rid not in rids or rid not in rec.ctx:
                continue
            spec = list(rec.spec_tokens.get(rid, ()))
            want = ref.rows(rid, rec.ctx[rid], spec)
            if want is None:
                continue  # the worker's context is already off-grammar
            for i, w in enumerate(want):
                if i >= len(rows) or not np.array_equal(
                        np.asarray(rows[i]).view(np.uint32)[:w.size],
                        w.view(np.uint32)):
                    v.append(f"step {n}: {rid} bitmask row {i} built from a "
                             f"stale grammar (worker had {len(rec.ctx[rid])} "
                             "output tokens)")
                    break
        for rid, raw in rec.raw_drafts.items():
            if rid not in rids or rid not in rec.ctx:
                continue
            spec = list(rec.spec_tokens.get(rid, ()))
            got = [t for t in spec if t >= 0]
            valid = ref.validate(rid, rec.ctx[rid], raw)
            if valid is None:
                continue
            slots = len(spec) if h.async_scheduling else h.num_spec_tokens
            if got != valid[:slots]:
                v.append(f"step {n}: {rid} drafts validated against a stale "
                         f"grammar: scheduled {got}, reference {valid[:slots]}")
        # A request in a step whose bitmask is built right away (sync
        # scheduler) must have no other step in flight.
    return v


def _run(h, rids: list[str], steps: int) -> list[str]:
    for _ in range(steps):
        h.engine_step()
    h.engine_drain()
    return check(h, rids)


def reference(h) -> Reference:
    """The harness's reference grammars (created on first use)."""
    ref = h.__dict__.get("_g1_reference")
    if ref is None:
        ref = h.__dict__["_g1_reference"] = Reference(h)
    return ref


def add_requests(h, n: int = 1, max_tokens: int = 12, prompt=None) -> list[str]:
    """Add `n` "(ab)+" requests (ignore_eos) and register them with the
    reference that `check` compares against."""
    p = prompt or [h.tok(c) for c in "xyzx"]
    rids = [h.add_request(p, regex=REGEX, ignore_eos=True, max_tokens=max_tokens)
            for _ in range(n)]
    for rid in rids:
        reference(h).add(rid)
    return rids


# ----------------------------------------------------------------- scenarios
def async_queue(depth: int, stagger: int | None = None, spec: int = 0):
    def run() -> list[str]:
        h = harness(async_scheduling=True, num_spec_tokens=spec)
        if stagger is not None:
            # V2 runner + PP decode cadence (0.32/0.33 async_scheduler.py):
            # a request is eligible again `decode_stagger` steps later.
            h.scheduler.use_v2_model_runner = True
            h.scheduler.decode_stagger = stagger
        h.engine_setup(depth, sampler, drafter if spec else None)
        # Plain requests launch first, so the structured prefills join a
        # queue that already holds a step (the audit's interleaving).
        plain = h.add_request([h.tok(c) for c in "xyzx"], max_tokens=14)
        h.engine_step()
        rids = add_requests(h, 2)
        assert plain not in rids
        return _run(h, rids, 12)

    return run


def sync_batch_queue_drafts() -> list[str]:
    """Gap 2: sync Scheduler + batch queue (PP, no async) + drafts."""
    h = harness(async_scheduling=False, num_spec_tokens=3)
    h.engine_setup(2, sampler, drafter)
    rids = add_requests(h, 1)
    return _run(h, rids, 10)


def sync_no_queue_drafts() -> list[str]:
    """Control: EngineCore.step + post_step with drafts."""
    h = harness(async_scheduling=False, num_spec_tokens=3)
    h.engine_setup(1, sampler, drafter)
    rids = add_requests(h, 1)
    return _run(h, rids, 8)


def preempt_resume_in_flight() -> list[str]:
    """Async depth 2: preempt a structured request with a step in flight
    (deliver mode), resume it, and keep going."""
    h = harness(async_scheduling=True)
    h.engine_setup(2, sampler)
    rids = add_requests(h, 2)
    for _ in range(3):
        h.engine_step()
    victim = h.request(rids[1])
    if victim in h.scheduler.running:
        h.scheduler.running.remove(victim)
        import time
        h.scheduler._preempt_request(victim, time.monotonic())  # noqa: SLF001
    v = _run(h, rids, 8)
    if not h.request(rids[1]).is_finished():
        v.append("preempted request did not finish")
    return v


def prefix_reset_in_flight() -> list[str]:
    """Async depth 2: reset_prefix_cache(reset_running_requests=True) with
    steps in flight (drop mode)."""
    h = harness(async_scheduling=True)
    h.engine_setup(2, sampler)
    rids = add_requests(h, 2)
    for _ in range(3):
        h.engine_step()
    h.scheduler.reset_prefix_cache(reset_running_requests=True)
    return _run(h, rids, 8)


def abort_in_flight() -> list[str]:
    """Async depth 3 (stagger 3): abort a structured request with a step in
    flight; the others keep current grammars, nothing stays gated."""
    from vllm.v1.request import RequestStatus

    h = harness(async_scheduling=True)
    h.scheduler.use_v2_model_runner = True
    h.scheduler.decode_stagger = 2
    h.engine_setup(3, sampler)
    rids = add_requests(h, 3)
    for _ in range(4):
        h.engine_step()
    h.scheduler.finish_requests([rids[0]], RequestStatus.FINISHED_ABORTED)
    v = _run(h, rids[1:], 10)
    for r in rids[1:]:
        if not h.request(r).is_finished():
            v.append(f"{r} did not finish after the abort")
    return v


def kv_recompute_async() -> list[str]:
    """Gap C: async, a failed KV load (recompute policy) of a request whose
    next step is already in flight."""
    h = harness(async_scheduling=True, block_size=4)
    h.engine_setup(2, sampler)
    prompt = [h.tok(c) for c in "xyzxyzxy"]  # two full blocks
    (rid,) = add_requests(h, 1, prompt=prompt)
    # step 1: prefill (samples), queued; step 2: decode, deferred -> pops 1.
    h.engine_step()
    first = h.steps[-1]
    so1 = h.batch_queue[0]
    blocks = h.scheduler.kv_cache_manager.get_block_ids(rid)[0]
    h.fail_kv_load(so1, [blocks[0]], recompute=[rid])
    assert rid in first.scheduled
    v = _run(h, [rid], 10)
    req = h.request(rid)
    if not req.is_finished() and req.num_output_placeholders and \
            not h.batch_queue:
        v.append(f"{rid}: {req.num_output_placeholders} placeholder(s) left "
                 "with no step in flight")
    return v


SCENARIOS: list[Scenario] = [
    Scenario("g1-async-queue2", "G1",
             "async, batch queue 2 (stock-correct path)",
             async_queue(2), stock_fails=False),
    Scenario("g1-async-queue2-spec", "G1",
             "async, batch queue 2, 3 drafts (stock-correct path)",
             async_queue(2, spec=3), stock_fails=False),
    Scenario("g1-async-queue3-stagger2", "G1",
             "async, batch queue 3, decode stagger 2 = pp (V2 PP, CUDA)",
             async_queue(3, stagger=2), stock_fails=False),
    Scenario("g1-async-queue5-stagger4", "G1",
             "async, batch queue 5, decode stagger 4 = pp",
             async_queue(5, stagger=4), stock_fails=False),
    Scenario("g1-stagger-queue3-stagger1", "G1",
             "decode stagger below the pipeline depth: async, batch queue 3, decode stagger 1 (XPU microbatch off)",
             async_queue(3, stagger=1),
             stock_violations=(
                 "step 2: r1 bitmask row 0 built from a stale grammar (worker "
                 "had 1 output tokens)",
                 "step 2: r2 bitmask row 0 built from a stale grammar (worker "
                 "had 1 output tokens)")),
    Scenario("g1-stagger-queue3-stagger1-spec", "G1",
             "decode stagger below the pipeline depth, with 3 drafts", async_queue(3, stagger=1, spec=3),
             stock_violations=(
                 "step 2: r1 bitmask row 0 built from a stale grammar (worker "
                 "had 1 output tokens)",
                 "step 2: r2 bitmask row 0 built from a stale grammar (worker "
                 "had 1 output tokens)",
                 "step 2: r1 drafts validated against a stale grammar: "
                 "scheduled [70, 71, 70], reference []",
                 "step 2: r2 drafts validated against a stale grammar: "
                 "scheduled [70, 71, 70], reference []")),
    Scenario("g1-stagger-queue5-stagger2", "G1",
             "decode stagger below the pipeline depth: async, batch queue 5, decode stagger 2 < pp",
             async_queue(5, stagger=2),
             stock_violations=(
                 "step 3: r1 bitmask row 0 built from a stale grammar (worker "
                 "had 1 output tokens)",
                 "step 3: r2 bitmask row 0 built from a stale grammar (worker "
                 "had 1 output tokens)")),
    Scenario("g1-sync-batch-queue-drafts", "G1",
             "sync scheduler with a batch queue (pipeline parallelism), batch queue 2, 3 drafts",
             sync_batch_queue_drafts,
             stock_violations=(
                 "step 1: r0 bitmask row 0 built from a stale grammar (worker "
                 "had 1 output tokens)",
                 "step 1: r0 drafts validated against a stale grammar: "
                 "scheduled [70, 71, 70], reference []")),
    Scenario("g1-sync-drafts", "G1", "sync EngineCore.step + drafts (control)",
             sync_no_queue_drafts, stock_fails=False),
    Scenario("g1-preempt-resume", "G1",
             "preempt and resume a structured request with a step in flight",
             preempt_resume_in_flight, stock_fails=False),
    Scenario("g1-prefix-reset", "G1",
             "reset_prefix_cache(reset_running_requests) with steps in flight",
             prefix_reset_in_flight, stock_fails=False),
    Scenario("g1-abort-in-flight", "G1",
             "abort a structured request with a step in flight",
             abort_in_flight, stock_fails=False),
    Scenario("g1-kv-recompute-async", "G1",
             "async + KV-load failure with recompute policy",
             kv_recompute_async,
             stock_violations=(
                 "step 1: r0 bitmask row 0 built from a stale grammar (worker "
                 "had 1 output tokens)",
                 "step 2: r0 bitmask row 0 built from a stale grammar (worker "
                 "had 0 output tokens)")),
]
