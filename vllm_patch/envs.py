"""Every environment variable vllm_patch reads, parsed in one typed place.

Values are read at call time (not cached at import), so a test or a CLI
subprocess can set them before calling `vllm_patch.register()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{name}={raw!r} is not a boolean; use 1/0, true/false, yes/no or on/off"
    )


def _optional_flag(name: str) -> bool | None:
    """None when the variable is unset (the patch's own default applies)."""
    return _flag(name, False) if os.environ.get(name, "").strip() else None


def _number(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} must not be negative")
    return value


def _names(name: str) -> frozenset[str]:
    raw = os.environ.get(name, "")
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


@dataclass(frozen=True)
class Settings:
    # Apply no guarantee patch: stock vLLM (test-only switches obey only
    # their own variables, see patching.disabled).
    disable: bool
    # Comma-separated patch names not to apply.
    skip: frozenset[str]
    # Start-up: a guarantee that cannot be enforced (unverifiable or failing
    # patch) stops vLLM from starting instead of being reported.
    strict: bool
    # Runtime: stale grammar state that would be used despite G1's mechanism
    # (its safety net firing) raises instead of being corrected.
    strict_runtime: bool
    # G2: grammar termination finishes a structured request (0 restores stock).
    stop_on_grammar_termination: bool
    # Runtime invariant checker; off by default in serving.
    check_invariants: bool
    # Tests: an invariant violation raises instead of being logged/counted.
    invariants_raise: bool
    # TEST ONLY: keep async scheduling on the CPU platform, which silently
    # turns it off. Never set this in production.
    test_force_async_scheduling: bool
    # NixlConnector's CPU KV-transfer core taken from the instance's
    # VLLM_CPU_OMP_THREADS_BIND cores. None (unset): on, except under
    # VLLM_PATCH_DISABLE=1; True: on even there; False: off.
    nixl_cpu_core_in_bind: bool | None
    # Grammar-aware drafting (speculative decoding + structured outputs): a
    # draft position where the grammar allows exactly one token gets that
    # token as its draft. On by default when patched.
    forced_drafts: bool
    # Grammar-aware drafting: the drafter's (EAGLE / draft model) proposals
    # are masked by the grammar position by position. On by default.
    masked_drafts: bool
    # Grammar-aware drafting's cost model: a batch drafts under the grammar
    # only while the expected gain in accepted tokens exceeds its measured
    # cost (False: always, e.g. to measure it).
    draft_cost_model: bool
    # The modelled cost of one device-to-host synchronisation between two
    # draft positions on an accelerator, in microseconds (no GPU here to
    # measure it on; 0 on the CPU, where there is nothing to wait for).
    draft_sync_us: float
    # Speculative verification rows (the scheduler's bitmask for each
    # draft) filled on vLLM's fill threads, request chunks side by side,
    # where the backend releases the GIL and the batch is large. On by
    # default.
    parallel_verify: bool


ENV_VARS: dict[str, str] = {
    "VLLM_PATCH_DISABLE": (
        "1 applies no guarantee patch (stock vLLM); a TEST ONLY switch set by "
        "its own variable still applies"
    ),
    "VLLM_PATCH_SKIP": "comma-separated patch names not to apply",
    "VLLM_PATCH_STRICT": (
        "1 makes a guarantee that cannot be enforced (unverifiable or failing "
        "patch) a start-up error"
    ),
    "VLLM_PATCH_STRICT_RUNTIME": (
        "1 raises when stale grammar state would be used despite the G1 "
        "mechanism (a bug in vLLM or a custom scheduler), instead of "
        "correcting it"
    ),
    "VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION": (
        "0 restores stock termination (grammar end is not a stop condition); "
        "no effect on G2 on a patched vLLM build that carries it (the "
        "build's own scheduler stops at the grammar's end)"
    ),
    "VLLM_PATCH_CHECK_INVARIANTS": "1 turns on the runtime invariant checker",
    "VLLM_PATCH_INVARIANTS_RAISE": (
        "1 makes an invariant violation raise (tests) instead of log + count"
    ),
    "VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING": (
        "TEST ONLY: keep async scheduling on the CPU platform"
    ),
    "VLLM_PATCH_NIXL_CPU_CORE_IN_BIND": (
        "on by default: NixlConnector's KV-transfer core on a CPU host is one "
        "of the instance's VLLM_CPU_OMP_THREADS_BIND cores (vLLM puts every "
        "NIXL instance of a host on its last core); 0 turns it off, 1 keeps "
        "it on under VLLM_PATCH_DISABLE=1"
    ),
    "VLLM_PATCH_FORCED_DRAFTS": (
        "on by default: with speculative decoding, a draft position where a "
        "structured request's grammar allows exactly one token gets that "
        "token as its draft; 0 turns it off"
    ),
    "VLLM_PATCH_MASKED_DRAFTS": (
        "on by default: with an EAGLE or draft-model drafter, a structured "
        "request's drafts are chosen among the tokens its grammar allows, "
        "position by position; 0 turns it off"
    ),
    "VLLM_PATCH_DRAFT_COST_MODEL": (
        "on by default: grammar-aware drafting runs for a batch only while "
        "its expected gain in accepted tokens exceeds its measured cost; 0 "
        "drafts under the grammar always"
    ),
    "VLLM_PATCH_DRAFT_SYNC_US": (
        "the cost model's price of one device-to-host synchronisation "
        "between two draft positions on a GPU, in microseconds (default 30)"
    ),
    "VLLM_PATCH_PARALLEL_VERIFY": (
        "0 fills the speculative verification rows on the engine thread "
        "alone, as stock does (default: on vLLM's fill threads for large "
        "xgrammar batches, by llguidance's batch walk for large guidance "
        "batches)"
    ),
}


def settings() -> Settings:
    return Settings(
        disable=_flag("VLLM_PATCH_DISABLE", False),
        skip=_names("VLLM_PATCH_SKIP"),
        strict=_flag("VLLM_PATCH_STRICT", False),
        strict_runtime=_flag("VLLM_PATCH_STRICT_RUNTIME", False),
        stop_on_grammar_termination=_flag(
            "VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION", True
        ),
        check_invariants=_flag("VLLM_PATCH_CHECK_INVARIANTS", False),
        invariants_raise=_flag("VLLM_PATCH_INVARIANTS_RAISE", False),
        test_force_async_scheduling=_flag(
            "VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING", False
        ),
        nixl_cpu_core_in_bind=_optional_flag("VLLM_PATCH_NIXL_CPU_CORE_IN_BIND"),
        forced_drafts=_flag("VLLM_PATCH_FORCED_DRAFTS", True),
        masked_drafts=_flag("VLLM_PATCH_MASKED_DRAFTS", True),
        draft_cost_model=_flag("VLLM_PATCH_DRAFT_COST_MODEL", True),
        draft_sync_us=_number("VLLM_PATCH_DRAFT_SYNC_US", 30.0),
        parallel_verify=_flag("VLLM_PATCH_PARALLEL_VERIFY", True),
    )
