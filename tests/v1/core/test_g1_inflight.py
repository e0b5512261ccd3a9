"""G1: grammar state is current when it is used (scheduler tier).

Every scenario of vllm_patch.conformance.g1 emulates EngineCore's loop with
a queue of in-flight scheduler outputs against the real scheduler and checks
every bitmask row / validated draft list against a reference grammar.
Patched, G1 must hold; stock (VLLM_PATCH_DISABLE=1), the gap scenarios must
show the stale case and the controls must hold.
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_patch.conformance import g1

pytestmark = pytest.mark.scheduler

@pytest.mark.parametrize("scenario", g1.SCENARIOS, ids=lambda s: s.name)
def test_g1_scenario(scenario, check_scenario):
    check_scenario(scenario)


def _normal_async_run(spec: int):
    """Async, batch queue 2: every bitmask row, scheduled set and draft list."""
    h = g1.harness(async_scheduling=True, num_spec_tokens=spec)
    h.engine_setup(2, g1.sampler, g1.drafter if spec else None)
    plain = h.add_request([h.tok(c) for c in "xyzx"], max_tokens=10)
    h.engine_step()
    rids = g1.add_requests(h, 3)
    for _ in range(14):
        h.engine_step()
    h.engine_drain()
    out = []
    for rec in h.steps:
        rows = {r: np.asarray(v).tobytes() for r, v in (rec.bitmask_rows or {}).items()}
        out.append((rec.scheduled, rec.spec_tokens, rows, rec.sampled,
                    rec.num_acceptable_drafts))
    out.append([list(h.request(r).output_token_ids) for r in rids + [plain]])
    return out


@pytest.mark.parametrize("spec", [0, 3])
def test_normal_async_identical_to_stock(patched, plugin_g1, spec):
    """The stock-correct path (async, queue 2) is bit-identical to stock."""
    import vllm_patch
    from vllm_patch import patching
    from vllm_patch.v1.core.sched.scheduler import g1_inflight as inflight

    before = dict(inflight.COUNTS)
    with_patches = _normal_async_run(spec)
    if not patched:
        return
    assert inflight.COUNTS == before, "the mechanism corrected something"
    # Only G1's patches: G2/G3 change rows after -1 drafts on purpose.
    for p in inflight.PATCHES:
        patching.revert_patch(p.name)
    try:
        stock = _normal_async_run(spec)
    finally:
        vllm_patch.register()
    assert with_patches == stock


def test_gate_work_counted(patched, plugin_g1):
    """The gate's work in the PP-stagger flow is counted (process totals by
    delta; per scheduler in test_g1_strict_runtime) and the safety net stays
    quiet. Raising is for the safety net only (VLLM_PATCH_STRICT_RUNTIME=1,
    test_g1_strict_runtime). Stock: nothing counted, the flow shows the
    stale rows."""
    from vllm_patch.v1.core.sched.scheduler import g1_inflight as inflight

    before = dict(inflight.COUNTS)
    violations = g1.async_queue(3, stagger=1)()
    delta = {k: inflight.COUNTS[k] - before[k] for k in inflight.KINDS}
    if not patched:
        assert violations != []
        assert delta == dict.fromkeys(inflight.KINDS, 0)
        return
    assert violations == []
    assert delta[inflight.GATE] > 0
    assert all(delta[k] == 0 for k in inflight.SAFETY_NET), delta


def test_unapplied_steps_tracking(patched, plugin_g1):
    """The per-request count follows launches, processing and aborts."""
    if not patched:
        pytest.skip("patched only")
    from vllm.v1.request import RequestStatus

    from vllm_patch.v1.core.sched.scheduler import g1_inflight as inflight

    h = g1.harness(async_scheduling=True)
    h.scheduler.use_v2_model_runner = True
    h.scheduler.decode_stagger = 2
    h.engine_setup(3, g1.sampler)
    (rid,) = g1.add_requests(h, 1)
    h.engine_step()
    assert inflight.unapplied_steps(h.scheduler, rid) == 1
    h.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
    assert inflight.unapplied_steps(h.scheduler, rid) == 0
    h.engine_drain()
    assert not inflight.state(h.scheduler).fifo


def test_bitmask_check_corrects_when_gate_bypassed(patched, plugin_g1, monkeypatch):
    """Defense in depth: with the schedule gate removed (as a custom
    scheduler that bypasses it would), the bitmask check preempts the lagging
    request in drop mode instead of building a stale row. Stock: the same
    flow builds stale rows."""
    if not patched:
        assert g1.async_queue(3, stagger=1)() != []
        return
    import vllm_patch
    from vllm_patch import patching
    from vllm_patch.v1.core.sched.scheduler import g1_inflight as inflight

    monkeypatch.delenv("VLLM_PATCH_STRICT_RUNTIME", raising=False)
    before = inflight.COUNTS[inflight.BITMASK]
    patching.revert_patch("g1-gate-schedule")
    try:
        violations = g1.async_queue(3, stagger=1)()
    finally:
        vllm_patch.register()
    assert violations == []
    assert inflight.COUNTS[inflight.BITMASK] > before
