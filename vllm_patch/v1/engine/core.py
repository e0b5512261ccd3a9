"""Package infrastructure: an engine-core probe (no guarantee of its own).

Adds `EngineCore.vllm_patch_probe()`, a method vLLM does not have, so a client
can ask the live engine core, through vLLM's own utility-call mechanism
(`EngineCoreClient.call_utility("vllm_patch_probe")`, dispatched by
`EngineCore._handle_client_request` with `getattr(self, method_name)`), which
patches are applied in *that* process and whether the scheduler it actually
built carries them. In-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) the same
method is called directly. Client-side helpers: `vllm_patch.testing.engine`.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_patch.patching import NAME_ATTR, Patch

PROBE_METHOD = "vllm_patch_probe"
INJECT_METHOD = "vllm_patch_inject_invariant_violation"


def _qualname(klass: type) -> str:
    return f"{klass.__module__}.{klass.__qualname__}"


def _tag(raw: Any) -> str | None:
    func = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    if isinstance(func, property):
        func = func.fget
    name = getattr(func, NAME_ATTR, None)
    return None if name is None else str(name)


def patched_methods(klass: type) -> list[list[str]]:
    """[class, method, patch name] for every patched attribute defined on a
    class of `klass`'s MRO (including ones a subclass overrides)."""
    found = []
    for base in klass.__mro__:
        for name, raw in sorted(vars(base).items()):
            patch = _tag(raw)
            if patch is not None:
                found.append([_qualname(base), name, patch])
    return found


def live_patched_methods(klass: type) -> list[list[str]]:
    """The subset an instance of `klass` actually calls: the first
    definition along the MRO, as attribute lookup resolves it."""
    live = []
    for entry in patched_methods(klass):
        for base in klass.__mro__:
            if entry[1] in vars(base):
                if _qualname(base) == entry[0]:
                    live.append(entry)
                break
    return live


def probe_report(engine_core: Any) -> dict[str, Any]:
    """What the plugin did in this process, and what the live objects carry.

    A plain function so it also works on an unpatched in-process engine."""
    import vllm_patch
    from vllm_patch import envs, patching

    scheduler = getattr(engine_core, "scheduler", None)
    sched_cls = type(scheduler) if scheduler is not None else None
    return {
        "pid": os.getpid(),
        "vllm": patching.vllm_version(),
        "vllm_patch": vllm_patch.__version__,
        "disabled": envs.settings().disable,
        "outcomes": {
            name: patching.REGISTRY.outcomes[name].state.value
            if name in patching.REGISTRY.outcomes
            else patching.State.NOT_REGISTERED.value
            for name in patching.REGISTRY.patches
        },
        "engine_core_class": _qualname(type(engine_core)),
        "engine_core_patched": patched_methods(type(engine_core)),
        "scheduler_class": _qualname(sched_cls) if sched_cls else None,
        "scheduler_mro": [_qualname(k) for k in sched_cls.__mro__] if sched_cls else [],
        "scheduler_patched": patched_methods(sched_cls) if sched_cls else [],
        "scheduler_live_patched": live_patched_methods(sched_cls) if sched_cls else [],
        # Per-object patches installed on the live scheduler itself.
        "scheduler_object_patched": sorted(
            getattr(v, patching.NAME_ATTR) for v in vars(scheduler).values()
            if isinstance(getattr(v, patching.NAME_ATTR, None), str)
        ) if scheduler is not None else [],
        "async_scheduling": bool(getattr(engine_core, "async_scheduling", False)),
        "batch_queue_size": int(getattr(engine_core, "batch_queue_size", 1)),
        "batch_queue": getattr(engine_core, "batch_queue", None) is not None,
        "step_fn": getattr(getattr(engine_core, "step_fn", None), "__name__", None),
    }


def _make_probe(original: Any) -> Any:
    assert original is None

    def vllm_patch_probe(self) -> dict[str, Any]:
        return probe_report(self)

    return vllm_patch_probe


def _make_inject(original: Any) -> Any:
    assert original is None

    def vllm_patch_inject_invariant_violation(
            self, invariant: str = "idle_pool",
            detail: str = "injected (self-test)") -> dict[str, Any]:
        """Report one violation of `invariant` through the live scheduler's
        invariant checker, as a real one would be (serving mode: one log
        line, counted on vllm_patch_invariant_violations_total wherever
        /metrics is served). Checks the metrics path end to end."""
        from vllm_patch.v1.core.sched.scheduler import invariants as inv

        scheduler = getattr(self, "scheduler", None)
        if scheduler is None or not inv.instrumented(scheduler):
            return {"injected": False, "reason": "scheduler not checked"}
        c = inv.checker(scheduler)
        if c.mode == "raise":
            return {"injected": False, "reason": "checker raises (tests)"}
        c.reported.discard((None, invariant))
        c.violate(invariant, None, detail)
        return {"injected": True, "pid": os.getpid(),
                "pending": dict(c.pending_counts)}

    return vllm_patch_inject_invariant_violation


PATCHES: list[Patch] = [
    Patch(
        name="engine-core-probe",
        guarantee="package",
        target=f"vllm.v1.engine.core:EngineCore.{PROBE_METHOD}",
        versions=("0.32", "0.33"),
        signature=(),
        make=_make_probe,
        why=("prove the plugin is active inside the engine-core process, on "
             "the scheduler it really built, not only in the client"),
        how=("adds EngineCore.vllm_patch_probe(), reachable through vLLM's "
             "utility calls (call_utility) or directly in-process"),
        upstream="none (package infrastructure)",
        remove_when="never; diagnostics",
        new_attribute=True,
    ),
    Patch(
        name="invariants-inject",
        guarantee="package",
        target=f"vllm.v1.engine.core:EngineCore.{INJECT_METHOD}",
        versions=("0.32", "0.33"),
        signature=(),
        make=_make_inject,
        why=("prove that a violation found by the checker in the engine-core "
             "process reaches the frontend's /metrics"),
        how=(f"adds EngineCore.{INJECT_METHOD}(invariant), reachable through "
             "vLLM's utility calls; it reports one violation through the live "
             "scheduler's checker (VLLM_PATCH_CHECK_INVARIANTS=1 only)"),
        upstream="none (package diagnostics)",
        remove_when="never; diagnostics",
        new_attribute=True,
        enabled=lambda s: s.check_invariants and not s.disable,
    ),
]
