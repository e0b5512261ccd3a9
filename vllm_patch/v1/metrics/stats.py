"""Patches of vllm.v1.metrics.stats.

- G2: per-request spec-decode metrics never count more accepted tokens than
  real drafts (scheduler-level stats: see vllm_patch.v1.core.sched.scheduler).
- Issue 8 (opt-in, VLLM_PATCH_CHECK_INVARIANTS=1): a SchedulerStats field
  that carries the invariant checker's violation counts from the engine core
  to the frontend (see vllm_patch.v1.metrics.loggers)."""

from __future__ import annotations

from typing import Any

from vllm_patch.patching import Patch
from vllm_patch.v1.core.sched.scheduler import UPSTREAM


def _make_observe(original):
    def observe(self, num_draft_tokens, num_accepted, detailed=False):
        # The scheduler passes drafts already net of grammar-invalidated ones.
        if num_accepted > num_draft_tokens:
            num_accepted = max(num_draft_tokens, 0)
        return original(self, num_draft_tokens, num_accepted, detailed)

    return observe


PATCHES: list[Patch] = [
    Patch(
        name="g2-request-spec-metrics-cap",
        guarantee="G2",
        target="vllm.v1.metrics.stats:RequestSpecDecodeMetrics.observe",
        versions=("0.32", "0.33"),
        signature=("self", "num_draft_tokens", "num_accepted", "detailed"),
        make=_make_observe,
        why=("update_from_output observes (drafts - invalid, accepted): "
             "post-terminal acceptances make accepted > drafts"),
        how="cap num_accepted at num_draft_tokens",
        upstream=UPSTREAM,
        remove_when="vLLM caps accepted drafts at the grammar-valid drafts",
    ),
]


# ---------------------------------------------------------------------------
# Issue 8: the invariant checker's violation counts travel from the engine
# core to the frontend on SchedulerStats, as vLLM's own scheduler stats do
# (EngineCoreOutputs.scheduler_stats, msgpack-encoded between processes);
# the frontend's Prometheus logger counts them (vllm_patch.v1.metrics.loggers).

INVARIANT_FIELD = "vllm_patch_invariant_violations"
FIELD_PATCH = "invariants-scheduler-stats-field"


class _FieldValue:
    """Class attribute of the added field: an instance's value, else None.
    (A data descriptor rather than a bare None so the registry can
    recognise the patch as applied.)"""

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        return obj.__dict__.get(INVARIANT_FIELD)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[INVARIANT_FIELD] = value


def _make_field(original: Any) -> Any:
    """Adds the SchedulerStats field `vllm_patch_invariant_violations:
    dict[str, int] | None = None` (init=False: the constructor,
    dataclasses.replace and every vLLM call site are unchanged). msgspec
    encodes and decodes a dataclass by its `__dataclass_fields__` (which
    must stay a plain dict, so it is extended in place) and its
    annotations; the field then crosses the engine-core / frontend
    boundary like any SchedulerStats field. Reverting removes the class
    attribute; the field entry stays behind, inert (msgspec skips a field
    an instance does not have)."""
    import dataclasses

    from vllm.v1.metrics.stats import SchedulerStats

    from vllm_patch.patching import NAME_ATTR

    assert original is None
    typ = dict[str, int] | None
    fields = SchedulerStats.__dataclass_fields__
    if INVARIANT_FIELD not in fields:
        f = dataclasses.field(default=None, init=False)
        f.name = INVARIANT_FIELD
        f.type = typ
        f._field_type = dataclasses._FIELD  # noqa: SLF001
        fields[INVARIANT_FIELD] = f
    ann = SchedulerStats.__dict__.get("__annotations__")
    if ann is not None and INVARIANT_FIELD not in ann:
        ann[INVARIANT_FIELD] = typ
    value = _FieldValue()
    setattr(value, NAME_ATTR, FIELD_PATCH)  # the registry tags callables only
    return value


def _invariants_enabled(s) -> bool:
    return s.check_invariants and not s.disable


PATCHES.append(
    Patch(
        name=FIELD_PATCH,
        guarantee="package",
        target=f"vllm.v1.metrics.stats:SchedulerStats.{INVARIANT_FIELD}",
        versions=("0.32", "0.33"),
        signature=(),
        make=_make_field,
        new_attribute=True,
        why=("the invariant checker runs in the engine core; its Prometheus "
             "counter must be visible on the frontend's /metrics when the "
             "engine core is a separate process"),
        how=("adds the SchedulerStats field vllm_patch_invariant_violations "
             "(dict invariant -> new violations, init=False, default None); "
             "the checker puts its counts on the step's SchedulerStats"),
        upstream="none (package diagnostics, issue 8)",
        remove_when="never: opt-in diagnostics",
        enabled=_invariants_enabled,
    )
)
