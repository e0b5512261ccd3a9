"""G1: with pipeline parallelism + async scheduling on Model Runner V2, a
structured request's deferred step is validated with the drafts of the step
its grammar has applied (vLLM issue #54437).

The real AsyncScheduler (V2 decode cadence: a request is eligible again
`pp` steps later) runs in the harness's EngineCore loop with a batch queue
of pp + 1 = 3 (`step_with_batch_queue`, deferred sampling for structured
requests in flight). The fake runner hands drafts over the way Model Runner
V2 does, through vLLM's real `DraftTokensHandler` on CPU tensors (CUDA
streams and events, which it only uses to order an async copy, are
no-op stand-ins here): `sample_tokens` proposes drafts for every request of
its batch and calls `set_draft_tokens`; EngineCore's deferred branch calls
`take_draft_token_ids` = `get_draft_tokens`; the patched runner's
`execute_model` notes the scheduler's step on the handler (`note_step`, done
here only when that runner patch is applied). As on V2, the worker verifies
its own drafts (proposed after the request's previous step), accepting only
the first `num_acceptable_drafts` of them (`grammar_invalid_drafts`).

The fake model wants "abab..." (grammar `(ab)+`) and its drafter proposes
exactly the model's next tokens, so every draft is grammar-valid and right.
Stock: the deferred step is handed the drafts of the newest sampled step,
which never holds the request; its drafts are never validated and all are
rejected. Patched: each deferred step is validated with the request's own
drafts of its previous step, and they are accepted.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_patch.conformance import g1
from vllm_patch.testing.harness import Harness

pytestmark = [pytest.mark.scheduler, pytest.mark.usefixtures("plugin_g1")]

PP = 2
K = 2


class _NoOp:
    """Stands in for a CUDA stream / event on the CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None

    def __enter__(self) -> "_NoOp":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


@pytest.fixture
def cpu_streams(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", _NoOp)
    monkeypatch.setattr(torch.cuda, "Event", _NoOp)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _NoOp())
    monkeypatch.setattr(torch.cuda, "stream", lambda *a, **k: _NoOp())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda *a, **k: None,
                        raising=False)


def _runner_notes_step() -> bool:
    """Whether the installed V2 runner's execute_model notes the step (the
    worker side of the fix is applied)."""
    from vllm_patch.patching import REGISTRY, State

    got = REGISTRY.outcomes.get("g1-v2-step-drafts-step")
    return got is not None and got.state is State.APPLIED


class V2Harness(Harness):
    """Engine loop whose fake worker hands drafts over as Model Runner V2."""

    def v2_setup(self) -> None:
        from vllm.v1.worker.gpu.spec_decode.utils import DraftTokensHandler

        self.handler = DraftTokensHandler(torch.device("cpu"))
        self.notes_step = _runner_notes_step()
        self.req_drafts: dict[str, list[int]] = {}  # req_states.draft_tokens
        self.checks: list[tuple[list[int], str, list[int], list[int]]] = []
        self.accepted = self.proposed = 0

    def want(self, n: int) -> int:
        return self.tok("a") if n % 2 == 0 else self.tok("b")

    def _engine_launch(self, so: Any) -> None:
        super()._engine_launch(so)
        if self.notes_step:  # the patched runner's execute_model
            from vllm_patch.v1.worker.gpu.spec_decode.utils import note_step

            note_step(self.handler, so)

    def _engine_drafts(self) -> Any:  # take_draft_token_ids
        return self.handler.get_draft_tokens(), {}

    def _engine_sample(self, so: Any) -> None:  # sample_tokens
        self.grammar_bitmask(so)
        rec = so._vllm_patch_record
        limits = rec.num_acceptable_drafts or {}
        out: dict[str, list[int]] = {}
        for rid in so._vllm_patch_samples:
            rows = rec.bitmask_rows.get(rid) if rec.bitmask_rows else None
            n_spec = len(so.scheduled_spec_decode_tokens.get(rid, ()))
            mine = self.req_drafts.get(rid, [])[:n_spec]
            ctx = rec.ctx[rid]
            structured = rows is not None
            if structured and mine:
                got = [t for t in so.scheduled_spec_decode_tokens[rid] if t >= 0]
                self.checks.append((list(ctx), rid, got, list(mine)))
            limit = limits.get(rid, 0) if structured else n_spec
            toks: list[int] = []
            for i in range(n_spec + 1):
                row = rows[i] if rows is not None and i < len(rows) else None
                pick = g1._pick(self, row, self.want(len(ctx) + i))
                toks.append(pick)
                if i < min(limit, len(mine)) and mine[i] == pick:
                    continue
                break
            if structured:
                self.proposed += len(mine)
                self.accepted += len(toks) - 1
            out[rid] = toks
            self.worker_ctx.setdefault(rid, []).extend(toks)
        rec.sampled = out
        self._last_sampled = so
        # The speculator: drafts for every request of the batch, stored for
        # its next step and handed to DraftTokensHandler.
        batch = list(so.num_scheduled_tokens)
        drafts = []
        for rid in batch:
            n = len(self.worker_ctx.get(rid, ()))
            d = [self.want(n + i) for i in range(K)]
            self.req_drafts[rid] = d
            drafts.append(d)
        structured = any(self.scheduler.requests[r].use_structured_output
                         for r in batch if r in self.scheduler.requests)
        self.handler.set_draft_tokens(
            SimpleNamespace(req_ids=batch, has_structured_output_reqs=structured),
            torch.tensor(drafts, dtype=torch.int64).reshape(len(batch), K))


def _run() -> tuple[V2Harness, list[str]]:
    h = V2Harness("xgrammar", async_scheduling=True, num_spec_tokens=K)
    # V2 + pipeline parallel cadence (async_scheduler.py, 0.32 and 0.33).
    h.scheduler.use_v2_model_runner = True
    h.scheduler.decode_stagger = PP
    h.engine_setup(PP + 1)
    h.v2_setup()
    # A plain request keeps the pipeline busy: a step is sampled between
    # two steps of each structured request (stock's slot is right only
    # when nothing else was sampled in between).
    plain = h.add_request([h.tok(c) for c in "xyzx"], max_tokens=64)
    h.engine_step()
    rids = g1.add_requests(h, 2, max_tokens=16)
    assert plain not in rids
    for _ in range(16):
        h.engine_step()
    h.engine_drain()
    return h, rids


def test_deferred_step_gets_the_drafts_of_its_own_previous_step(patched, cpu_streams):
    h, rids = _run()
    ref = g1.reference(h)
    wrong = []
    for ctx, rid, got, mine in h.checks:
        if rid not in rids:
            continue
        want = ref.validate(rid, ctx, mine)
        if want is None:
            continue
        if got != want[:len(mine)]:
            wrong.append(f"after {len(ctx)} tokens: {rid} validated {got}, its drafts "
                         f"{mine} (valid: {want})")
    # Every bitmask row the worker got is the grammar's state after the
    # request's own tokens and validated drafts (G1 holds either way).
    assert g1.check(h, rids) == []
    for rid in rids:
        out = h.emitted(rid).token_ids
        assert out and ref.validate(rid, [], out) == out, (rid, out)
    assert h.checks, "no deferred step verified drafts"
    if patched:
        assert wrong == []
        assert h.accepted > 0 and h.accepted == h.proposed, (
            h.accepted, h.proposed)
    else:
        # Stock: the deferred step is handed the newest sampled step's drafts
        # (another step), so the request's own are never validated: every
        # draft is rejected.
        assert wrong and all(" validated [], " in w for w in wrong), wrong
        assert h.accepted == 0 and h.proposed > 0


@pytest.mark.patched_only
def test_step_reaches_the_worker_and_drafts_come_back_by_step(cpu_streams):
    """The step stamp survives the trip to a worker process (executors
    pickle the scheduler output), the patched V2 execute_model notes it on
    the draft handler (none for a dummy run), and the hand-over carries the
    drafts by step back through pickle."""
    import pickle

    from vllm.v1.worker.gpu.spec_decode.utils import DraftTokensHandler

    from vllm_patch import patching
    from vllm_patch.v1.worker.gpu.model_runner import PATCHES
    from vllm_patch.v1.worker.gpu.spec_decode.utils import STEP_ATTR

    h = Harness("xgrammar", async_scheduling=True, num_spec_tokens=K)
    rid = h.add_request([h.tok(c) for c in "xyzx"], regex=g1.REGEX,
                        ignore_eos=True, max_tokens=8)
    so = pickle.loads(pickle.dumps(h.schedule()))
    step = getattr(so, STEP_ATTR)
    assert isinstance(step, int)

    (patch,) = [p for p in PATCHES if p.name == "g1-v2-step-drafts-step"]
    assert patching.REGISTRY.patches[patch.name] is patch
    ran = []
    execute = patch.make(lambda self, s, *a, **k: ran.append(s))
    runner = SimpleNamespace(draft_tokens_handler=DraftTokensHandler(
        torch.device("cpu")))
    handler = runner.draft_tokens_handler
    execute(runner, so)
    assert ran == [so] and handler.__dict__[STEP_ATTR] == step
    handler.set_draft_tokens(
        SimpleNamespace(req_ids=[rid], has_structured_output_reqs=True),
        torch.tensor([[5, 6]]))
    execute(runner, so, None, True)  # a dummy run records nothing
    assert handler.__dict__[STEP_ATTR] is None
    handler.set_draft_tokens(
        SimpleNamespace(req_ids=[rid], has_structured_output_reqs=True),
        torch.tensor([[7, 8]]))
    got = pickle.loads(pickle.dumps(handler.get_draft_tokens()))
    assert got.req_ids == [rid] and got.draft_token_ids == [[7, 8]]
    assert got.by_step == {step: ([rid], [[5, 6]])}


@pytest.mark.patched_only
def test_a_resumed_request_has_no_previous_step():
    """After preemption the worker rebuilds the request without drafts: its
    first step after resuming takes no drafts of a step before it."""
    import time

    from vllm_patch.v1.core.sched.scheduler import g1_step_drafts

    h = Harness("xgrammar", async_scheduling=False, num_spec_tokens=K)
    rid = h.add_request([h.tok(c) for c in "xyzx"], regex=g1.REGEX,
                        ignore_eos=True, max_tokens=8)
    h.step({rid: [h.tok("a")]})
    h.step({rid: [h.tok("b")]})
    assert g1_step_drafts.previous_step(h.scheduler, rid) is not None
    req = h.request(rid)
    h.scheduler.running.remove(req)
    h.scheduler._preempt_request(req, time.monotonic())  # noqa: SLF001
    h.schedule()
    assert h.request(rid).num_preemptions == 1
    assert g1_step_drafts.previous_step(h.scheduler, rid) is None
