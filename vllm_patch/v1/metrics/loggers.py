"""`vllm_patch_invariant_violations_total` on the frontend's /metrics.

The invariant checker (vllm_patch.v1.core.sched.scheduler.invariants) runs
where the scheduler runs, in the engine core. Its violation counts ride on
the step's `SchedulerStats` (field `vllm_patch_invariant_violations`, added
by vllm_patch.v1.metrics.stats.invariants_field) to the frontend, where this
patch makes vLLM's `PrometheusStatLogger.record` count them next to vLLM's
own metrics (in-process and multiprocess engines alike; with
PROMETHEUS_MULTIPROC_DIR set, through prometheus_client's multiprocess mode
like vLLM's counters).
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from vllm_patch.patching import Patch

logger = init_logger(__name__)

METRIC = "vllm_patch_invariant_violations"
RECORD_PATCH = "invariants-prometheus-record"

_COUNTER: Any = None


def counter() -> Any:
    """The Counter `vllm_patch_invariant_violations_total{invariant}` on
    prometheus_client's default REGISTRY (False if prometheus_client is
    missing: metrics never break serving)."""
    global _COUNTER
    if _COUNTER is None:
        try:
            from prometheus_client import REGISTRY, Counter

            existing = getattr(REGISTRY, "_names_to_collectors", {}).get(METRIC)
            _COUNTER = existing if existing is not None else Counter(
                METRIC, "Scheduler invariant violations found by "
                "vllm_patch's checker (VLLM_PATCH_CHECK_INVARIANTS=1)",
                ["invariant"])
        except Exception as e:  # noqa: BLE001 - metrics never break serving
            logger.warning_once("vllm_patch: no %s counter on /metrics (%s: %s)",
                                METRIC, type(e).__name__, str(e))
            _COUNTER = False
    return _COUNTER


def count(violations: dict[str, int] | None) -> None:
    if not violations:
        return
    c = counter()
    if not c:
        return
    for invariant, n in violations.items():
        if n > 0:
            c.labels(invariant=invariant).inc(n)


def _make_record(original: Any) -> Any:
    from vllm_patch.v1.metrics.stats.invariants_field import INVARIANT_FIELD

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
               engine_idx=0):
        out = original(self, scheduler_stats, iteration_stats,
                       mm_cache_stats, engine_idx)
        if scheduler_stats is not None:
            try:
                count(getattr(scheduler_stats, INVARIANT_FIELD, None))
            except Exception as e:  # noqa: BLE001 - never break stats logging
                logger.warning_once(
                    "vllm_patch: invariant violations not counted on /metrics "
                    "(%s: %s)", type(e).__name__, str(e))
        return out

    return record


PATCHES: list[Patch] = [
    Patch(
        name=RECORD_PATCH,
        guarantee="package",
        target="vllm.v1.metrics.loggers:PrometheusStatLogger.record",
        versions=("0.32", "0.33"),
        signature=("self", "scheduler_stats", "iteration_stats",
                   "mm_cache_stats", "engine_idx"),
        make=_make_record,
        why=("the checker's counts come from the engine-core process; "
             "without this they never reach the frontend's /metrics"),
        how=("after vLLM records a step's stats, add the step's "
             "SchedulerStats.vllm_patch_invariant_violations to "
             "vllm_patch_invariant_violations_total{invariant}"),
        upstream="none (package diagnostics)",
        remove_when="never: opt-in diagnostics",
        enabled=lambda s: s.check_invariants and not s.disable,
    ),
]
