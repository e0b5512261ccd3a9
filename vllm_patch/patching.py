"""The patch registry.

A `Patch` is a record: which guarantee it serves, which vLLM attribute it
replaces, which vLLM release series its code was written against, the
parameter names it expects the target to have, how to build the replacement
from the original, and why it exists / when it can go. `vllm-patch status`
prints these records.

Applying is verified and idempotent: a patch is applied only when the
installed vLLM belongs to a series the patch knows and the target exists with
the expected signature; applying twice never wraps twice. Anything that
cannot be verified is skipped with one warning naming the guarantee left
unenforced, or raises `PatchError` under `VLLM_PATCH_STRICT=1`.
"""

from __future__ import annotations

import enum
import functools
import importlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from vllm_patch import envs

logger = logging.getLogger("vllm_patch")

# vLLM release series whose source the patches of this package were written
# and tested against. A series outside this set is "unknown": nothing applied.
KNOWN_SERIES: tuple[str, ...] = ("0.32", "0.33")

GUARANTEES: dict[str, str] = {
    "G1": "grammar state is current when it is used",
    "G2": "nothing past the grammar's end is committed",
    "G3": "drafts are never verified against a row that allows post-terminal tokens",
    "G4": "disaggregated decode keeps G1-G3 and loses no KV",
}

# What a guarantee does NOT cover even when all its patches are applied.
# `vllm-patch status` prints these under the guarantee, so "patched" never
# claims more than is enforced. Keep in step with the issue notes.
KNOWN_LIMITS: dict[str, tuple[str, ...]] = {
    "G1": (
        "gap 3 (pipeline parallel + async + spec decode: structured requests "
        "get the drafts of the wrong batch) is not fixed: it needs per-step "
        "draft snapshots on the worker (cf. vLLM PR #56802) and cannot run "
        "on the CPU build",
    ),
    "G2": (
        "tested with the xgrammar, guidance and outlines backends; "
        "lm-format-enforcer is not tested",
    ),
    "G3": (
        "the drafter (EAGLE / draft_model) is skipped only in steps where "
        "every request of the batch has ended or ends; in a batch where "
        "others go on it still runs over the ended requests (their drafts "
        "are dropped, no compute saved); ngram / suffix / medusa drafting "
        "is not skipped; an end by max_tokens is not predicted",
    ),
    "G4": (
        "the KV load overlaps grammar compilation only for connectors that "
        "pull asynchronously (do_remote_prefill, e.g. NixlConnector); "
        "ExampleConnector loads synchronously and keeps the stock order",
        "a grammar that fails to compile on the decode side after the "
        "transfer was requested is tested at the scheduler tier only (the "
        "API server rejects such grammars before they reach the engine)",
    ),
}

# Ids that are not guarantees: package infrastructure and test-only switches.
NON_GUARANTEE_IDS = ("package", "test-only")

ORIGINAL_ATTR = "__vllm_patch_original__"
NAME_ATTR = "__vllm_patch_name__"
# Whether the owner defined the attribute itself before patching (else it was
# inherited, and revert deletes the replacement to restore inheritance).
HAD_OWN_ATTR = "__vllm_patch_had_own__"


class PatchError(RuntimeError):
    """A patch could not be verified and VLLM_PATCH_STRICT=1 is set."""


class State(str, enum.Enum):
    APPLIED = "applied"
    NOT_APPLICABLE = "not needed on this version"
    DISABLED = "disabled (VLLM_PATCH_DISABLE=1)"
    SKIPPED_BY_USER = "skipped (VLLM_PATCH_SKIP)"
    OFF = "off (opt-in patch not enabled)"
    UNKNOWN_VERSION = "skipped: unknown vLLM version"
    TARGET_MISSING = "skipped: target not found"
    SIGNATURE_MISMATCH = "skipped: signature differs"
    NOT_REGISTERED = "not registered yet"


# States that leave the patch's guarantee unenforced (and warn).
UNENFORCED_STATES = (
    State.DISABLED,
    State.SKIPPED_BY_USER,
    State.UNKNOWN_VERSION,
    State.TARGET_MISSING,
    State.SIGNATURE_MISMATCH,
)


def source_digest(obj: Any) -> str | None:
    """sha256[:16] of `inspect.getsource(obj)` (the function inside a
    classmethod / staticmethod), or None when no source is available."""
    import hashlib

    func = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    try:
        return hashlib.sha256(inspect.getsource(func).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return None


@dataclass(frozen=True)
class Pin:
    """vLLM source a patch relies on without replacing it: a function whose
    logic the patch mirrors, or whose unwritten behaviour it depends on.
    Pinned to the audited source per series (sha256[:16] of
    `inspect.getsource`); a series absent from `digests` has nothing pinned.
    On a mismatch the patch is not applied (its guarantee is not enforced)
    unless `fallback` is set: then the patch applies and runs its fallback
    implementation, and status says so."""

    # "module.path:Owner.attr" in vLLM.
    target: str
    digests: dict[str, str]
    # What the patch relies on in that source.
    relies_on: str
    fallback: bool = False


@dataclass(frozen=True)
class Patch:
    name: str
    guarantee: str
    # "module.path:Owner.attr" (Owner optional for module-level functions).
    target: str
    # vLLM release series ("0.32", "0.33") this code was written against. A
    # known series not listed here means the patch is not needed there.
    versions: tuple[str, ...]
    # Parameter names the target must have, in order (self included).
    signature: tuple[str, ...]
    # Builds the replacement from the original attribute.
    make: Callable[[Any], Any]
    why: str
    how: str
    upstream: str
    remove_when: str
    # Opt-in patches (test-only switches) apply only when this returns True.
    enabled: Callable[[envs.Settings], bool] | None = None
    # Adds an attribute vLLM does not have: the owner must exist and the
    # attribute must NOT; no signature check; `make(None)` builds it; revert
    # deletes it.
    new_attribute: bool = False
    # Wraps an attribute per object (e.g. one KV connector instance), not on
    # the class: applying verifies the target on the class and arms the
    # patch; `wrap_instance(name, obj)` then installs `make(obj.<attr>)` on
    # the object; revert removes it from every object it was installed on.
    per_instance: bool = False
    # vLLM source this patch mirrors or relies on (see Pin).
    pins: tuple[Pin, ...] = ()
    # False: the guarantee still holds without this patch (another path
    # takes over); its failure is reported but does not withdraw the rest.
    required: bool = True
    # Run on revert after the attribute is restored (e.g. to remove a
    # dataclass field entry the patch added).
    undo: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        ids = tuple(GUARANTEES) + NON_GUARANTEE_IDS
        if self.guarantee not in ids:
            raise ValueError(f"patch {self.name}: guarantee must be one of {ids}")
        if ":" not in self.target:
            raise ValueError(f"patch {self.name}: target must be 'module:attr'")

    @property
    def module_name(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def attr_path(self) -> list[str]:
        return self.target.split(":", 1)[1].split(".")

    def record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "guarantee": self.guarantee,
            "target": self.target,
            "versions": list(self.versions),
            "why": self.why,
            "how": self.how,
            "upstream": self.upstream,
            "remove_when": self.remove_when,
        }


@dataclass
class Outcome:
    patch: Patch
    state: State
    detail: str = ""
    # Where the original was found, to revert exactly.
    owner: Any = None
    attr: str = ""
    had_own_attr: bool = False
    original: Any = None


@dataclass
class Registry:
    patches: dict[str, Patch] = field(default_factory=dict)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    # (patch, state, detail) already warned about: one warning per skipped
    # patch per process, however often register() runs.
    warned: set[tuple[str, str, str]] = field(default_factory=set)

    def add(self, patch: Patch) -> None:
        existing = self.patches.get(patch.name)
        if existing is not None and existing is not patch:
            raise ValueError(f"two patches named {patch.name!r}")
        # One patch per attribute and vLLM series: a second wrapper on top of
        # another patch would hide it from revert and re-apply (the registry
        # recognises a patch only as the outermost wrapper). Compose inside
        # one patch instead.
        for other in self.patches.values():
            if (other is not patch and other.target == patch.target
                    and set(other.versions) & set(patch.versions)):
                raise ValueError(
                    f"patches {other.name!r} and {patch.name!r} both replace "
                    f"{patch.target} on vLLM {sorted(set(other.versions) & set(patch.versions))}"
                )
        self.patches[patch.name] = patch


REGISTRY = Registry()


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def version_series(version: str) -> str:
    """'0.32.0+cpu' -> '0.32'; anything unparsable -> the raw string."""
    try:
        from packaging.version import Version

        release = Version(version).release
        return f"{release[0]}.{release[1]}"
    except Exception:
        return version


def _resolve(patch: Patch) -> tuple[Any, str, Any, bool]:
    """Return (owner, attr, original, owner_defines_attr); raises LookupError."""
    try:
        owner: Any = importlib.import_module(patch.module_name)
    except ImportError as exc:
        raise LookupError(f"module {patch.module_name} not importable: {exc}") from exc
    path = patch.attr_path
    for part in path[:-1]:
        if not hasattr(owner, part):
            raise LookupError(f"{patch.module_name} has no {part}")
        owner = getattr(owner, part)
    attr = path[-1]
    if patch.new_attribute:
        if hasattr(owner, attr):
            current = getattr(owner, attr)
            if getattr(current, NAME_ATTR, None) == patch.name:
                return owner, attr, current, False
            raise LookupError(f"{patch.target} already exists in vLLM")
        return owner, attr, None, False
    own = attr in vars(owner) if hasattr(owner, "__dict__") else False
    if own:
        original = vars(owner)[attr]
    elif hasattr(owner, attr):
        original = getattr(owner, attr)
    else:
        raise LookupError(f"{patch.target} does not exist")
    return owner, attr, original, own


def _tag_holder(obj: Any) -> Any:
    """Where patch attributes live: the function inside a classmethod or
    staticmethod (a bound method forwards attribute reads to it)."""
    return obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj


def _signature_of(obj: Any) -> tuple[str, ...] | None:
    func = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    try:
        return tuple(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None


def _unenforced(outcome: Outcome, settings: envs.Settings) -> Outcome:
    patch = outcome.patch
    what = GUARANTEES.get(patch.guarantee, patch.guarantee)
    msg = (
        f"vllm_patch: patch {patch.name} NOT applied ({outcome.state.value}"
        f"{': ' + outcome.detail if outcome.detail else ''}); "
        f"{patch.guarantee} ({what}) is NOT enforced on vLLM {vllm_version()}"
    )
    if settings.strict and outcome.state not in (State.DISABLED, State.SKIPPED_BY_USER):
        raise PatchError(msg + " [VLLM_PATCH_STRICT=1]")
    key = (patch.name, outcome.state.value, outcome.detail)
    if key not in REGISTRY.warned:
        REGISTRY.warned.add(key)
        logger.warning(msg)
    return outcome


def disabled(patch: Patch, settings: envs.Settings) -> bool:
    """VLLM_PATCH_DISABLE=1 turns off every patch except the test-only
    switches, which obey only their own opt-in variable: they put stock vLLM
    into the configuration a stock-vs-patched comparison needs (e.g. async
    scheduling on the CPU), so both runs measure the same set-up."""
    return settings.disable and patch.guarantee != "test-only"


def apply_patch(patch: Patch, settings: envs.Settings) -> Outcome:
    wanted = not (
        disabled(patch, settings)
        or (patch.enabled is not None and not patch.enabled(settings))
        or patch.name in settings.skip
    )
    previous = REGISTRY.outcomes.get(patch.name)
    if previous is not None and previous.state is State.APPLIED:
        current = getattr(previous.owner, previous.attr, None)
        if getattr(current, NAME_ATTR, None) == patch.name:
            if wanted:
                return previous  # idempotent: already in place
            # Switched off since it was applied: stock again, as reported.
            revert_patch(patch.name)

    if disabled(patch, settings):
        outcome = Outcome(patch, State.DISABLED)
    elif patch.enabled is not None and not patch.enabled(settings):
        # Under VLLM_PATCH_DISABLE=1 everything not applied reads "disabled".
        outcome = Outcome(patch, State.DISABLED if settings.disable else State.OFF)
    elif patch.name in settings.skip:
        outcome = _unenforced(Outcome(patch, State.SKIPPED_BY_USER), settings)
    else:
        outcome = _verify_and_apply(patch, settings)
    REGISTRY.outcomes[patch.name] = outcome
    return outcome


def _verify_and_apply(patch: Patch, settings: envs.Settings) -> Outcome:
    version = vllm_version()
    series = version_series(version)
    if series not in KNOWN_SERIES:
        return _unenforced(
            Outcome(patch, State.UNKNOWN_VERSION,
                    f"{version}; known series: {', '.join(KNOWN_SERIES)}"),
            settings,
        )
    if series not in patch.versions:
        return Outcome(patch, State.NOT_APPLICABLE, f"vLLM {series}")
    try:
        owner, attr, original, own = _resolve(patch)
    except LookupError as exc:
        return _unenforced(Outcome(patch, State.TARGET_MISSING, str(exc)), settings)

    if getattr(_tag_holder(original), NAME_ATTR, None) == patch.name:
        # Applied by an earlier registry instance (e.g. module reloaded).
        # `own` is True now that the replacement is in place; the tag says
        # whether the original was the owner's own or inherited.
        holder = _tag_holder(original)
        return Outcome(patch, State.APPLIED, "already applied", owner, attr,
                       getattr(holder, HAD_OWN_ATTR, own),
                       getattr(holder, ORIGINAL_ATTR))

    found = _signature_of(original)
    if not patch.new_attribute and found != patch.signature:
        return _unenforced(
            Outcome(patch, State.SIGNATURE_MISMATCH,
                    f"expected {patch.signature}, found {found}"),
            settings,
        )

    replacement = patch.make(original)
    holder = _tag_holder(replacement)
    if callable(holder) and not isinstance(holder, type):
        if inspect.isfunction(_tag_holder(original)) and inspect.isfunction(holder):
            functools.update_wrapper(holder, _tag_holder(original))
        setattr(holder, NAME_ATTR, patch.name)
        setattr(holder, ORIGINAL_ATTR, original)
        setattr(holder, HAD_OWN_ATTR, own)
    setattr(owner, attr, replacement)
    logger.debug("vllm_patch: applied %s to %s", patch.name, patch.target)
    return Outcome(patch, State.APPLIED, "", owner, attr, own, original)


def revert_patch(name: str) -> None:
    outcome = REGISTRY.outcomes.get(name)
    if outcome is None or outcome.state is not State.APPLIED:
        return
    current = getattr(outcome.owner, outcome.attr, None)
    if getattr(current, NAME_ATTR, None) == name:
        if outcome.had_own_attr:
            setattr(outcome.owner, outcome.attr, outcome.original)
        else:
            delattr(outcome.owner, outcome.attr)
    del REGISTRY.outcomes[name]


def revert_all() -> None:
    for name in list(REGISTRY.outcomes):
        revert_patch(name)


def apply_all(settings: envs.Settings) -> list[Outcome]:
    return [apply_patch(p, settings) for p in REGISTRY.patches.values()]


def guarantee_table() -> list[dict[str, Any]]:
    """One row per guarantee: native / patched / not enforced, with patches."""
    rows = []
    for gid, text in GUARANTEES.items():
        patches = [p for p in REGISTRY.patches.values() if p.guarantee == gid]
        outcomes = [
            REGISTRY.outcomes.get(p.name, Outcome(p, State.NOT_REGISTERED))
            for p in patches
        ]
        needed = [o for o in outcomes if o.state is not State.NOT_APPLICABLE]
        if not patches:
            status = "not enforced"
            reason = "no patch for this guarantee in this vllm_patch version"
        elif not needed:
            status = "native"
            reason = "every patch for it is unneeded on this vLLM version"
        elif all(o.state is State.APPLIED for o in needed):
            status = "patched"
            reason = ""
        else:
            status = "not enforced"
            reason = "; ".join(
                f"{o.patch.name}: {o.state.value}" for o in needed
                if o.state is not State.APPLIED
            )
        rows.append({
            "guarantee": gid,
            "text": text,
            "status": status,
            "reason": reason,
            "limits": list(KNOWN_LIMITS.get(gid, ())) if status != "not enforced" else [],
            "patches": [
                {**o.patch.record(), "state": o.state.value, "detail": o.detail}
                for o in outcomes
            ],
        })
    return rows
