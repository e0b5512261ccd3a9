"""The patch registry.

A `Patch` is a record: the guarantee it serves, the vLLM attribute it
replaces, the vLLM series its code was written against, the signature it
expects, the vLLM source it mirrors or relies on (`Pin`), how to build the
replacement, and why it exists / when it can go. `vllm-patch status` prints
these records.

Applying is verified, idempotent and all-or-nothing per guarantee: a patch
applies only on a known vLLM series with its target, signature and pins as
audited, and any exception while importing, checking, building or applying
is caught (state ERROR). If one required patch of a guarantee cannot be
applied, the guarantee's other patches are withdrawn (reverted), and one
warning line per guarantee says which patch and why. vLLM always starts;
`VLLM_PATCH_STRICT=1` turns an unenforced guarantee into a start-up error.
"""

from __future__ import annotations

import enum
import functools
import importlib
import inspect
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from vllm_patch import envs

logger = logging.getLogger(__name__)

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
        "async scheduling with speculative decoding: as in stock, a "
        "structured request that is not scheduled in the step it was "
        "eligible for gets no drafts for its next step (one token there)",
    ),
    "G2": (
        "tested with the xgrammar, guidance and outlines backends; "
        "lm-format-enforcer is not tested",
    ),
    "G3": (
        "the drafter is skipped only in steps where every request of the "
        "batch has ended or ends; in a batch where others go on it still runs "
        "over the ended requests (their drafts are dropped, no compute "
        "saved); an end by max_tokens is not predicted",
        "V1 runner: only the EAGLE / MTP / draft_model / DFlash / Gemma4 "
        "proposers are skipped; ngram (CPU or GPU), suffix, medusa, "
        "extract_hidden_states and custom proposers, and pipeline parallel, "
        "keep drafting",
        "Model Runner V2: any of its speculators is skipped, except with "
        "pipeline or data parallelism (the other ranks run it in step), "
        "where the drafts of ended requests are still dropped",
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


IMPL_ATTR = "__vllm_patch_impl__"


class PatchError(RuntimeError):
    """A guarantee cannot be enforced and VLLM_PATCH_STRICT=1 is set."""


class State(str, enum.Enum):
    APPLIED = "applied"
    NOT_APPLICABLE = "not needed on this version"
    NATIVE = "native (patched build)"
    DISABLED = "disabled (VLLM_PATCH_DISABLE=1)"
    SKIPPED_BY_USER = "skipped (VLLM_PATCH_SKIP)"
    OFF = "off (opt-in patch not enabled)"
    UNKNOWN_VERSION = "skipped: unknown vLLM version"
    TARGET_MISSING = "skipped: target not found"
    SIGNATURE_MISMATCH = "skipped: signature differs"
    SOURCE_DRIFT = "skipped: vLLM source differs from the audited one"
    ERROR = "error"
    WITHDRAWN = "withdrawn: its guarantee cannot be enforced"
    NOT_REGISTERED = "not registered yet"


# The patch cannot be applied on this vLLM: its guarantee is not enforced.
FAILED_STATES = (
    State.UNKNOWN_VERSION,
    State.TARGET_MISSING,
    State.SIGNATURE_MISMATCH,
    State.SOURCE_DRIFT,
    State.ERROR,
)
# States that leave (part of) the patch's guarantee unenforced.
UNENFORCED_STATES = FAILED_STATES + (
    State.DISABLED, State.SKIPPED_BY_USER, State.WITHDRAWN)


# code object -> digest: several patches pin the same vLLM function, and
# register() runs in every vLLM process; read each source once.
_DIGESTS: dict[Any, str | None] = {}


def source_digest(obj: Any) -> str | None:
    """sha256[:16] of `inspect.getsource(obj)` (the function inside a
    classmethod / staticmethod), or None when no source is available."""
    import hashlib

    func = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    # Keyed by the innermost function's code: decorators such as
    # torch.inference_mode share one wrapper code object between all the
    # functions they wrap (getsource follows __wrapped__ the same way).
    try:
        inner = inspect.unwrap(func)
    except ValueError:
        inner = func
    code = getattr(inner, "__code__", None)
    if code is not None and code in _DIGESTS:
        return _DIGESTS[code]
    try:
        digest = hashlib.sha256(inspect.getsource(func).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        digest = None
    if code is not None:
        _DIGESTS[code] = digest
    return digest


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
    # series -> the digest on the vLLM build made from this package's patch
    # series, accepted too (a patch that still applies on that build).
    build_digests: dict[str, str] = field(default_factory=dict)


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
    # For an optional patch: what runs instead when it is not applied
    # (printed by status).
    without: str = ""
    # Applies under VLLM_PATCH_DISABLE=1 too when this returns True (a fix
    # its own variable turned on explicitly, so a stock run can keep the
    # set-up of a patched one).
    keep_when_disabled: Callable[[envs.Settings], bool] | None = None
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

    @property
    def defined_in(self) -> str:
        """The vllm_patch module that defines this patch."""
        return getattr(self.make, "__module__", None) or "?"

    def record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "guarantee": self.guarantee,
            "target": self.target,
            "defined_in": self.defined_in,
            "required": self.required,
            "pins": [p.target for p in self.pins],
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
    # Which implementation is live (the replacement's IMPL_ATTR, else
    # "wrapper"; "per-object wrapper" / "added attribute" by kind).
    impl: str = ""
    # Pins that differ but have a fallback implementation.
    drift: str = ""


@dataclass
class Registry:
    patches: dict[str, Patch] = field(default_factory=dict)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    # Patch module -> error text, for modules that failed to import, and the
    # guarantees each such module serves (none of them is enforced).
    module_errors: dict[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)
    # Per-object patches: patch name -> weak references to the objects
    # wrapped (listed by status, removed by revert).
    instances: dict[str, list[weakref.ref]] = field(default_factory=dict)
    # Warning lines already logged (once per process, however often
    # register() runs).
    warned: set[str] = field(default_factory=set)

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
                    and other.per_instance == patch.per_instance
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


def resolve_target(target: str) -> Any:
    """The object at "module.path:Owner.attr" (LookupError if absent)."""
    module_name, _, path = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise LookupError(f"module {module_name} not importable: {exc}") from exc
    for part in path.split("."):
        if part in getattr(obj, "__dict__", {}):
            obj = obj.__dict__[part]  # keeps staticmethod / classmethod
        elif hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            raise LookupError(f"{target} does not exist")
    return obj


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


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def check_pins(patch: Patch, series: str) -> tuple[list[str], list[str]]:
    """(blocking, tolerated): descriptions of the pins of `patch` whose vLLM
    source differs from the audited one on `series` (tolerated: the patch
    has a fallback implementation for it)."""
    blocking: list[str] = []
    tolerated: list[str] = []
    for pin in patch.pins:
        want = pin.digests.get(series)
        if want is None:
            continue
        try:
            found = source_digest(resolve_target(pin.target))
        except LookupError as exc:
            found, why = None, str(exc)
        else:
            why = "no source" if found is None else f"source {found}, audited {want}"
        if found != want and found != pin.build_digests.get(series):
            (tolerated if pin.fallback else blocking).append(
                f"{pin.target} ({why}; relied on: {pin.relies_on})")
    return blocking, tolerated


def disabled(patch: Patch, settings: envs.Settings) -> bool:
    """VLLM_PATCH_DISABLE=1 turns off every patch except the test-only
    switches, which obey only their own opt-in variable: they put stock vLLM
    into the configuration a stock-vs-patched comparison needs (e.g. async
    scheduling on the CPU), so both runs measure the same set-up."""
    if patch.keep_when_disabled is not None and patch.keep_when_disabled(settings):
        return False
    return settings.disable and patch.guarantee != "test-only"


def _wanted(patch: Patch, settings: envs.Settings) -> State | None:
    """None if the patch should be applied, else the state that says why not."""
    if disabled(patch, settings):
        return State.DISABLED
    if patch.enabled is not None and not patch.enabled(settings):
        # Under VLLM_PATCH_DISABLE=1 everything not applied reads "disabled".
        return State.DISABLED if settings.disable else State.OFF
    if patch.name in settings.skip:
        return State.SKIPPED_BY_USER
    return None


@dataclass
class _Verified:
    """A patch whose target, signature and pins check out, not installed yet."""

    owner: Any
    attr: str
    original: Any
    own: bool
    drift: str


def apply_patch(patch: Patch, settings: envs.Settings) -> Outcome:
    """Verify and apply one patch (idempotent), regardless of its
    guarantee's other patches (`apply_all` adds all-or-nothing). Never
    raises: any exception is the outcome's ERROR state."""
    result = _check(patch, settings)
    if isinstance(result, _Verified):
        result = _install(patch, result)
    REGISTRY.outcomes[patch.name] = result
    return result


def _check(patch: Patch, settings: envs.Settings) -> Outcome | _Verified:
    """The patch's outcome if it needs no (new) install, else _Verified."""
    try:
        unwanted = _wanted(patch, settings)
        previous = REGISTRY.outcomes.get(patch.name)
        if previous is not None and previous.state is State.APPLIED:
            if _in_place(previous) and unwanted is None:
                return previous  # idempotent: already in place
            # Switched off since it was applied, or replaced behind our
            # back: stock again, as reported.
            revert_patch(patch.name)
        native = _native_outcome(patch)
        if native is not None:
            # What the build does itself, whatever the plugin's switches.
            return native
        if unwanted is not None:
            return Outcome(patch, unwanted)
        return _verify(patch)
    except Exception as exc:  # noqa: BLE001 - a patch must never stop vLLM
        return Outcome(patch, State.ERROR, _error_text(exc))


def _in_place(outcome: Outcome) -> bool:
    patch = outcome.patch
    if patch.per_instance:
        return True
    current = getattr(outcome.owner, outcome.attr, None)
    return getattr(current, NAME_ATTR, None) == patch.name


def _verify(patch: Patch) -> Outcome | _Verified:
    version = vllm_version()
    series = version_series(version)
    if series not in KNOWN_SERIES:
        return Outcome(patch, State.UNKNOWN_VERSION,
                       f"{version}; known series: {', '.join(KNOWN_SERIES)}")
    if series not in patch.versions:
        return Outcome(patch, State.NOT_APPLICABLE, f"vLLM {series}")
    try:
        owner, attr, original, own = _resolve(patch)
    except LookupError as exc:
        return Outcome(patch, State.TARGET_MISSING, str(exc))

    if not patch.per_instance and \
            getattr(_tag_holder(original), NAME_ATTR, None) == patch.name:
        # Applied by an earlier registry instance (e.g. module reloaded).
        # `own` is True now that the replacement is in place; the tag says
        # whether the original was the owner's own or inherited.
        holder = _tag_holder(original)
        return Outcome(patch, State.APPLIED, "already applied", owner, attr,
                       getattr(holder, HAD_OWN_ATTR, own),
                       getattr(holder, ORIGINAL_ATTR),
                       impl=getattr(holder, IMPL_ATTR, "wrapper"))

    found = _signature_of(original)
    if not patch.new_attribute and found != patch.signature:
        return Outcome(patch, State.SIGNATURE_MISMATCH,
                       f"expected {patch.signature}, found {found}")
    blocking, tolerated = check_pins(patch, series)
    if blocking:
        return Outcome(patch, State.SOURCE_DRIFT, "; ".join(blocking))
    return _Verified(owner, attr, original, own, "; ".join(tolerated))


def _native_outcome(patch: Patch) -> Outcome | None:
    """NATIVE when the installed vLLM build carries `patch` itself (its
    patch series names it, or carries its whole guarantee), on a series the
    patch is written for; None otherwise."""
    native = _native_ids()
    whole = native_guarantees().get(patch.guarantee)
    if patch.name not in native and whole is None:
        return None
    if version_series(vllm_version()) not in patch.versions:
        return None  # not for this series: _verify says so
    if patch.name in native:
        # This vLLM build carries the fix itself (the patch series).
        return Outcome(patch, State.NATIVE, native[patch.name])
    # The build carries this patch's guarantee whole: none of its patches
    # applies on top of the build's own code, not even one its series does
    # not name (a plugin newer than the build's series).
    return Outcome(patch, State.NATIVE,
                   f"{whole['series_patch']} (carries {patch.guarantee}; "
                   f"this plugin patch is not named by the build's series)")


_NATIVE: list[dict[str, str]] = []


def _native_ids() -> dict[str, str]:
    """Plugin patch ids the installed vLLM build carries (read once)."""
    if not _NATIVE:
        from vllm_patch.series import native_patch_ids
        _NATIVE.append(native_patch_ids())
    return _NATIVE[0]


_NATIVE_GUARANTEES: list[dict[str, dict[str, Any]]] = []


def native_guarantees() -> dict[str, dict[str, Any]]:
    """Guarantees the installed vLLM build carries whole (its patch series'
    records): id -> {"series_patch", "runners", "replaces"} (read once)."""
    if not _NATIVE_GUARANTEES:
        from vllm_patch.series import native_guarantees as read
        _NATIVE_GUARANTEES.append(read())
    return _NATIVE_GUARANTEES[0]


def guarantee_native(gid: str, runner: str | None = None) -> bool:
    """Whether the installed vLLM build enforces guarantee `gid` itself
    (on model runner `runner`, if given), with or without this plugin."""
    whole = native_guarantees().get(gid)
    return whole is not None and (runner is None or runner in whole["runners"])


def _install(patch: Patch, v: _Verified) -> Outcome:
    """Install a verified patch. Never raises (ERROR state instead)."""
    if patch.per_instance:
        # Armed: wrap_instance() installs it on the objects it is given.
        return Outcome(patch, State.APPLIED, "", v.owner, v.attr, v.own,
                       v.original, impl="per-object wrapper", drift=v.drift)
    try:
        replacement = patch.make(v.original)
        holder = _tag_holder(replacement)
        impl = getattr(holder, IMPL_ATTR, None) or (
            "added attribute" if patch.new_attribute else "wrapper")
        if callable(holder) and not isinstance(holder, type):
            if inspect.isfunction(_tag_holder(v.original)) and \
                    inspect.isfunction(holder):
                # update_wrapper copies the original's __dict__: set the
                # replacement's own implementation tag again after it.
                functools.update_wrapper(holder, _tag_holder(v.original))
                setattr(holder, IMPL_ATTR, impl)
            setattr(holder, NAME_ATTR, patch.name)
            setattr(holder, ORIGINAL_ATTR, v.original)
            setattr(holder, HAD_OWN_ATTR, v.own)
        setattr(v.owner, v.attr, replacement)
    except Exception as exc:  # noqa: BLE001 - a patch must never stop vLLM
        return Outcome(patch, State.ERROR, _error_text(exc))
    logger.debug("vllm_patch: applied %s to %s", patch.name, patch.target)
    return Outcome(patch, State.APPLIED, "", v.owner, v.attr, v.own,
                   v.original, impl=impl, drift=v.drift)


def wrap_instance(name: str, obj: Any, *context: Any, force: bool = False) -> bool:
    """Install per-object patch `name` on `obj`: `obj.<attr>` becomes
    `make(obj.<attr>, *context)` (an instance attribute). Only while the
    patch is applied (armed), unless `force` (test tooling that instruments
    an object explicitly, e.g. in a stock run). Idempotent; the object is
    remembered (weakly) so revert removes the wrap. Returns whether `obj`
    carries the wrap."""
    patch = REGISTRY.patches.get(name)
    if patch is None or not patch.per_instance:
        raise KeyError(f"no per-object patch named {name!r}")
    outcome = REGISTRY.outcomes.get(name)
    if not force and (outcome is None or outcome.state is not State.APPLIED):
        return False
    attr = patch.attr_path[-1]
    d = getattr(obj, "__dict__", None)
    if d is None:
        return False
    if getattr(d.get(attr), NAME_ATTR, None) == name:
        return True
    replacement = patch.make(getattr(obj, attr), *context)
    setattr(replacement, NAME_ATTR, name)
    d[attr] = replacement
    refs = REGISTRY.instances.setdefault(name, [])
    refs[:] = [r for r in refs if r() is not None]
    refs.append(weakref.ref(obj))
    return True


def _unwrap_instances(name: str, attr: str) -> None:
    for ref in REGISTRY.instances.pop(name, []):
        obj = ref()
        d = getattr(obj, "__dict__", None)
        if d is not None and getattr(d.get(attr), NAME_ATTR, None) == name:
            del d[attr]


def revert_patch(name: str) -> None:
    outcome = REGISTRY.outcomes.get(name)
    patch = REGISTRY.patches.get(name) or (outcome.patch if outcome else None)
    if patch is not None and patch.per_instance:
        _unwrap_instances(name, patch.attr_path[-1])
    if outcome is None or outcome.state is not State.APPLIED:
        return
    if not outcome.patch.per_instance and _in_place(outcome):
        if outcome.had_own_attr:
            setattr(outcome.owner, outcome.attr, outcome.original)
        else:
            delattr(outcome.owner, outcome.attr)
        if outcome.patch.undo is not None:
            outcome.patch.undo()
    del REGISTRY.outcomes[name]


def revert_all() -> None:
    for name in list(REGISTRY.outcomes) + list(REGISTRY.instances):
        revert_patch(name)


def _warn_once(msg: str) -> None:
    if msg not in REGISTRY.warned:
        REGISTRY.warned.add(msg)
        logger.warning(msg)


def _failures(gid: str) -> list[str]:
    """Why guarantee `gid` cannot be enforced (empty: nothing failed)."""
    reasons: dict[str, list[str]] = {}
    for o in REGISTRY.outcomes.values():
        if o.patch.guarantee == gid and o.patch.required and \
                o.state in FAILED_STATES:
            why = o.state.value + (f": {o.detail}" if o.detail else "")
            reasons.setdefault(why, []).append(o.patch.name)
    out = [f"{', '.join(names)} NOT applied ({why})"
           for why, names in reasons.items()]
    out += [f"patch module {mod} failed to import ({err})"
            for mod, (gids, err) in REGISTRY.module_errors.items() if gid in gids]
    return out


def apply_all(settings: envs.Settings) -> list[Outcome]:
    """Apply every registered patch, then enforce all-or-nothing per
    guarantee: when a required patch of a guarantee failed, its applied
    patches are withdrawn. Logs one line per unenforced guarantee; under
    VLLM_PATCH_STRICT=1 raises PatchError instead (after withdrawing)."""
    # Verify everything first, so a guarantee that cannot be enforced is
    # never installed in part, not even for a moment.
    verified: dict[str, _Verified] = {}
    for patch in REGISTRY.patches.values():
        result = _check(patch, settings)
        if isinstance(result, _Verified):
            verified[patch.name] = result
            REGISTRY.outcomes.pop(patch.name, None)
        else:
            REGISTRY.outcomes[patch.name] = result
    doomed = {gid for gid in GUARANTEES if _failures(gid)}
    for name, v in verified.items():
        patch = REGISTRY.patches[name]
        if patch.guarantee in doomed:
            REGISTRY.outcomes[name] = Outcome(patch, State.WITHDRAWN)
        else:
            REGISTRY.outcomes[name] = _install(patch, v)
    unenforced: list[str] = []
    version = vllm_version()
    for gid, text in GUARANTEES.items():
        failures = _failures(gid)
        if failures:
            for o in list(REGISTRY.outcomes.values()):
                if o.patch.guarantee == gid and \
                        o.state in (State.APPLIED, State.WITHDRAWN):
                    revert_patch(o.patch.name)  # no-op unless applied
                    REGISTRY.outcomes[o.patch.name] = Outcome(
                        o.patch, State.WITHDRAWN, "; ".join(failures))
            msg = (f"vllm_patch: {gid} ({text}) is NOT enforced on vLLM "
                   f"{version}: {'; '.join(failures)}")
            unenforced.append(msg)
            if not settings.strict:
                _warn_once(msg)
        skipped = [o.patch.name for o in REGISTRY.outcomes.values()
                   if o.patch.guarantee == gid and o.state is State.SKIPPED_BY_USER]
        if skipped and not failures:
            _warn_once(f"vllm_patch: {gid} ({text}) is only partly enforced on "
                       f"vLLM {version}: {', '.join(skipped)} NOT applied "
                       f"(skipped by VLLM_PATCH_SKIP)")
    if not settings.stop_on_grammar_termination and not settings.disable \
            and guarantee_native("G2"):
        _warn_once(
            "vllm_patch: VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION=0 is ignored "
            "for G2 on this vLLM build: the build's own scheduler stops at "
            "the grammar's end (patch series); G2 stays enforced")
    if settings.nixl_cpu_core_in_bind is False \
            and "cpu-nixl-kv-core-in-bind" in _native_ids():
        _warn_once(
            "vllm_patch: VLLM_PATCH_NIXL_CPU_CORE_IN_BIND=0 is ignored on this "
            "vLLM build: the build itself keeps NixlConnector's KV-transfer "
            "core within VLLM_CPU_OMP_THREADS_BIND (patch series)")
    for gid in NON_GUARANTEE_IDS:  # one line per kind, not per patch
        failures = _failures(gid)
        if failures:
            msg = (f"vllm_patch: {gid} patches NOT applied on vLLM {version}: "
                   f"{'; '.join(failures)}")
            unenforced.append(msg)
            if not settings.strict:
                _warn_once(msg)
    if settings.strict and unenforced and not settings.disable:
        raise PatchError(" | ".join(unenforced) + " [VLLM_PATCH_STRICT=1: "
                         "vLLM does not start while a guarantee is not enforced]")
    return list(REGISTRY.outcomes.values())


def impl_summary(gid: str) -> str:
    """What runs instead of the optional patches of guarantee `gid` that are
    not applied while the guarantee is ('' when none)."""
    outcomes = [o for o in REGISTRY.outcomes.values() if o.patch.guarantee == gid]
    if not any(o.state is State.APPLIED for o in outcomes):
        return ""
    return "; ".join(
        f"{o.patch.without} ({o.patch.name} is not applied)"
        for o in outcomes if not o.patch.required
        and o.state not in (State.APPLIED, State.NOT_APPLICABLE, State.NATIVE))


def switched_off(gid: str, settings: envs.Settings) -> str:
    """What an environment switch turns off in guarantee `gid` ('' if none)."""
    if not settings.stop_on_grammar_termination:
        if gid == "G2":
            return ("VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION=0: grammar "
                    "termination is not a stop condition, tokens after the "
                    "grammar's end are committed as in stock vLLM (a rejected "
                    "token still finishes the request with only the valid "
                    "prefix emitted)")
        if gid == "G3":
            return ("VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION=0: drafting goes "
                    "on after the grammar's end (the draft skip is off)")
        if gid == "G4":
            return ("VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION=0: the decode "
                    "side keeps G2 and G3 only in part (see above)")
    return ""


# How a guarantee row's reason starts when the build carries some of its
# patches and the plugin applies the others.
PARTLY_NATIVE = "partly native"


def guarantee_table(settings: envs.Settings | None = None) -> list[dict[str, Any]]:
    """One row per guarantee: native / patched / partial / not enforced."""
    settings = settings or envs.settings()
    rows = []
    native = v2_native_checks()  # reads vLLM's V2 source once per table
    series = version_series(vllm_version())

    def other_series(o: Outcome) -> bool:
        # A patch for another known vLLM series (read "disabled" under
        # VLLM_PATCH_DISABLE=1, which is decided before the series).
        return series in KNOWN_SERIES and series not in o.patch.versions

    for gid, text in GUARANTEES.items():
        patches = [p for p in REGISTRY.patches.values() if p.guarantee == gid]
        outcomes = [
            REGISTRY.outcomes.get(p.name, Outcome(p, State.NOT_REGISTERED))
            for p in patches
        ]
        needed = [o for o in outcomes
                  if o.state not in (State.NOT_APPLICABLE, State.NATIVE)
                  and not other_series(o)]
        failures = _failures(gid)
        partial: list[str] = []
        if failures:
            status, reason = "not enforced", "; ".join(failures)
        elif not patches:
            status = "not enforced"
            reason = "no patch for this guarantee in this vllm_patch version"
        elif not needed and any(o.state is State.NATIVE for o in outcomes):
            status = "native (patched build)"
            notes = ["this vLLM build carries it (patch series)"]
            unnamed = [o.patch.name for o in outcomes
                       if o.state is State.NATIVE
                       and o.patch.name not in _native_ids()]
            if unnamed:
                notes.append(f"not applied although the build's series does "
                             f"not name them: {', '.join(unnamed)}")
            if gid == "G2" and not settings.stop_on_grammar_termination:
                notes.append("VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION=0 has no "
                             "effect on it (the build's own scheduler stops "
                             "at the grammar's end)")
            reason = "; ".join(notes)
        elif not needed:
            status = "native"
            reason = "every patch for it is unneeded on this vLLM version"
        elif not any(o.state is State.APPLIED for o in needed if o.patch.required):
            status = "not enforced"
            reason = "; ".join(sorted({o.state.value for o in needed}))
        else:
            missing = [o for o in needed if o.state is not State.APPLIED
                       and o.patch.required]
            partial = [f"{o.patch.name}: {o.state.value}" for o in missing]
            off = switched_off(gid, settings)
            if off:
                partial.append(off)
            status = "partial" if partial else "patched"
            carried = [o.patch.name for o in outcomes
                       if o.state is State.NATIVE and not other_series(o)]
            if carried:
                # Part of it is the build's own code (a series patch that
                # names these patches but not the whole guarantee).
                partial.append(f"{PARTLY_NATIVE}: {', '.join(carried)} carried "
                               f"by this vLLM build (patch series), the rest "
                               f"applied by the plugin")
            reason = "; ".join(partial)
        rows.append({
            "guarantee": gid,
            "text": text,
            "status": status,
            "reason": reason,
            "implementation": impl_summary(gid),
            "limits": list(KNOWN_LIMITS.get(gid, ())) if status != "not enforced" else [],
            "patches": [patch_row(o) for o in outcomes],
        })
        rows[-1]["runners"] = runner_rows(rows[-1], native)
    return rows


def patch_row(o: Outcome) -> dict[str, Any]:
    row = {**o.patch.record(), "state": o.state.value, "detail": o.detail,
           "implementation": o.impl if o.state is State.APPLIED else "",
           "source_drift": o.drift}
    if o.patch.per_instance:
        row["objects"] = sum(1 for r in REGISTRY.instances.get(o.patch.name, ())
                             if r() is not None)
    return row


# --------------------------------------------------------------------------
# Per model runner. vLLM has two worker-side model runners: V1
# (vllm/v1/worker/gpu_model_runner.py; the CPU build's default) and Model
# Runner V2 (vllm/v1/worker/gpu/; CUDA's default on 0.33 when Triton is
# present). Scheduler-side patches hold for both; a patch whose target lives
# in one runner's files holds for that runner only.
# --------------------------------------------------------------------------

RUNNERS = ("V1", "V2")
_V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
_V2_RUNNER_PACKAGE = "vllm.v1.worker.gpu."

_V2_KEEPS_DRAFTING = ("Model Runner V2 keeps drafting after a grammar's end "
                      "(its draft-skip patches are not all applied)")
# What a guarantee does not cover on one runner even when its patches for
# that runner are applied (added to KNOWN_LIMITS, which holds for both).
RUNNER_LIMITS: dict[str, dict[str, tuple[str, ...]]] = {
    "V1": {
        "G1": ("vLLM 0.33 does not run this runner with pipeline parallelism "
               "+ async scheduling (it picks Model Runner V2 or refuses)",),
    },
    "V2": {
        "G1": ("drafts of the right step with pipeline parallelism + async "
               "scheduling (vLLM issue #54437): tested with the real "
               "scheduler and vLLM's own draft hand-over class in an "
               "emulated engine loop, not in a real pipeline-parallel engine "
               "(that needs two GPUs: scripts/validate_gpu.py)",),
        "G3": (_V2_KEEPS_DRAFTING,),
    },
}


def patch_runners(patch: Patch) -> tuple[str, ...]:
    """The model runners a patch's guarantee work holds for."""
    module = patch.target.split(":", 1)[0]
    if module == _V1_RUNNER_MODULE:
        return ("V1",)
    if module.startswith(_V2_RUNNER_PACKAGE):
        return ("V2",)
    return RUNNERS


def _v2_source(module: str, needle: str) -> bool:
    """Whether the installed vLLM's `module` source contains `needle`
    (read as text: importing V2 modules pulls in Triton kernels)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    origin = getattr(spec, "origin", None) if spec else None
    if not origin:
        return False
    try:
        with open(origin, encoding="utf-8") as f:
            return needle in f.read()
    except OSError:
        return False


def v2_native_checks() -> dict[str, str]:
    """Per guarantee, what Model Runner V2 on this vLLM does natively ('' if
    nothing)."""
    native = {}
    if _v2_source("vllm.v1.worker.gpu.structured_outputs",
                  "def grammar_invalid_drafts"):
        native["G3"] = ("Model Runner V2 rejects every draft past the "
                        "scheduler's num_acceptable_drafts itself "
                        "(grammar_invalid_drafts)")
    return native


def runner_rows(row: dict[str, Any], native_checks: dict[str, str] | None = None,
                ) -> dict[str, dict[str, Any]]:
    """For one guarantee_table row: its status on each model runner.

    A runner-specific patch counts only for its runner; the row's own
    failures (a required patch not applied, a switch turned off) hold for
    both. V2's native num_acceptable_drafts check replaces V1's worker-side
    acceptance patch."""
    gid = row["guarantee"]
    if native_checks is None:
        native_checks = v2_native_checks()
    native = native_checks.get(gid, "") if row["patches"] else ""
    out: dict[str, dict[str, Any]] = {}
    for runner in RUNNERS:
        mine = [p for p in row["patches"] if p["name"] in REGISTRY.patches
                and runner in patch_runners(REGISTRY.patches[p["name"]])]
        applied = [p["name"] for p in mine
                   if p["state"] == State.APPLIED.value]
        status = row["status"]
        detail = row["reason"]
        if runner == "V2" and native and status in ("patched", "partial"):
            # Missing V1-only patches do not concern V2.
            v1_only = {p["name"] for p in row["patches"]
                       if p["name"] in REGISTRY.patches
                       and patch_runners(REGISTRY.patches[p["name"]]) == ("V1",)}
            parts = [part for part in detail.split("; ") if part]
            carried = [part for part in parts if part.startswith(PARTLY_NATIVE)]
            rest = [part for part in parts if part not in carried
                    and part.split(":", 1)[0] not in v1_only]
            status = "partial" if rest else "patched"
            detail = "; ".join(rest + carried)
        whole = native_guarantees().get(gid)
        if status == "native (patched build)" and whole is not None and \
                runner not in whole["runners"]:
            # The build carries the guarantee for its other runner(s) only.
            status = "not enforced"
            detail = (f"this vLLM build carries {gid} for "
                      f"{', '.join(whole['runners']) or 'no model runner'} "
                      f"only ({whole['series_patch']})")
        limits = list(RUNNER_LIMITS[runner].get(gid, ()))
        own = [p for p in mine if patch_runners(REGISTRY.patches[p["name"]]) == (runner,)]
        if (runner == "V2" and own
                and all(p["state"] == State.APPLIED.value for p in own)):
            limits = [t for t in limits if t != _V2_KEEPS_DRAFTING]
        out[runner] = {
            "status": status,
            "reason": detail,
            "patches_applied": applied,
            "native": native if runner == "V2" else "",
            "limits": limits if status != "not enforced" else [],
        }
    return out


def selected_runner(vllm_config: Any = None) -> dict[str, Any]:
    """Which model runner vLLM uses: from `vllm_config` when given
    (VllmConfig.use_v2_model_runner), else what decides it here."""
    import os

    env = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if vllm_config is not None:
        try:
            v2 = bool(vllm_config.use_v2_model_runner)
        except Exception as exc:  # noqa: BLE001 - report, do not fail status
            return {"runner": None, "decided_by": f"the configuration: {_error_text(exc)}"}
        return {"runner": "V2" if v2 else "V1",
                "decided_by": "this configuration (VllmConfig.use_v2_model_runner)"}
    try:
        from vllm.triton_utils import HAS_TRITON
    except Exception:  # noqa: BLE001
        HAS_TRITON = False
    if env is not None and env.strip().lower() in ("1", "true", "0", "false"):
        v2 = env.strip().lower() in ("1", "true")
        note = ""
        if v2 and not HAS_TRITON:
            note = " (vLLM refuses to start: Model Runner V2 requires Triton)"
        return {"runner": "V2" if v2 else "V1",
                "decided_by": f"VLLM_USE_V2_MODEL_RUNNER={env}" + note}
    if not HAS_TRITON:
        return {"runner": "V1",
                "decided_by": "no usable Triton in this vLLM build and "
                              "VLLM_USE_V2_MODEL_RUNNER unset"}
    return {"runner": None,
            "decided_by": "Triton is usable and VLLM_USE_V2_MODEL_RUNNER is "
                          "unset: vLLM picks Model Runner V2 unless the "
                          "model / speculative / parallel configuration has "
                          "a feature V2 does not support, then V1 "
                          "(VllmConfig.use_v2_model_runner)"}
