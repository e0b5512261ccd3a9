"""Package diagnostics for vllm.v1.metrics.stats (opt-in,
VLLM_PATCH_CHECK_INVARIANTS=1): a SchedulerStats field that carries the
invariant checker's violation counts from the engine core to the frontend,
as vLLM's own scheduler stats travel (EngineCoreOutputs.scheduler_stats,
msgpack-encoded between processes); the frontend's Prometheus logger counts
them (vllm_patch.v1.metrics.loggers)."""

from __future__ import annotations

from typing import Any

from vllm_patch.patching import Patch

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
    attribute, then `_remove_field` the field entry and annotation."""
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


def _remove_field() -> None:
    """Undo of `_make_field`'s dataclass extension (after the registry has
    removed the class attribute)."""
    from vllm.v1.metrics.stats import SchedulerStats

    SchedulerStats.__dataclass_fields__.pop(INVARIANT_FIELD, None)
    ann = SchedulerStats.__dict__.get("__annotations__")
    if ann is not None:
        ann.pop(INVARIANT_FIELD, None)


def _invariants_enabled(s) -> bool:
    return s.check_invariants and not s.disable


PATCHES: list[Patch] = [
    Patch(
        name=FIELD_PATCH,
        guarantee="package",
        target=f"vllm.v1.metrics.stats:SchedulerStats.{INVARIANT_FIELD}",
        versions=("0.32", "0.33"),
        signature=(),
        make=_make_field,
        new_attribute=True,
        undo=_remove_field,
        why=("the invariant checker runs in the engine core; its Prometheus "
             "counter must be visible on the frontend's /metrics when the "
             "engine core is a separate process"),
        how=("adds the SchedulerStats field vllm_patch_invariant_violations "
             "(dict invariant -> new violations, init=False, default None); "
             "the checker puts its counts on the step's SchedulerStats"),
        upstream="none (package diagnostics)",
        remove_when="never: opt-in diagnostics",
        enabled=_invariants_enabled,
    )
]
