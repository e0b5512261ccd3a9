"""vllm_patch: grammar x speculative decoding x P/D guarantees for vLLM v1.

`register()` is the `vllm.general_plugins` entry point, so vLLM calls it in
every process that loads plugins (API server, engine core, workers, Ray
actors). It is idempotent and applies only what it can verify; see
`vllm_patch.patching` and ../shared/design/GUARANTEES.md.
"""

from __future__ import annotations

import importlib
import logging

__version__ = "0.1.0"

# Modules that define patches, each exposing PATCHES: list[Patch], with the
# guarantees they serve (if a module fails to import, those guarantees are
# not enforced). A patch for vLLM module vllm.X.Y lives in vllm_patch.X.Y
# (a folder with one file per guarantee when several patch that module).
PATCH_MODULES: dict[str, tuple[str, ...]] = {
    "vllm_patch.platforms.cpu": ("test-only", "package"),
    "vllm_patch.v1.engine.core": ("package",),
    "vllm_patch.v1.core.sched.scheduler.g1_inflight": ("G1",),
    "vllm_patch.v1.core.sched.scheduler.g2_commit_cut": ("G2",),
    "vllm_patch.v1.core.sched.scheduler.g4_kv_overlap": ("G4",),
    "vllm_patch.v1.core.sched.scheduler.invariants": ("package",),
    "vllm_patch.v1.core.block_pool": ("package",),
    "vllm_patch.v1.core.sched.async_scheduler": ("G2",),
    "vllm_patch.v1.metrics.stats.g2_spec_metrics_cap": ("G2",),
    "vllm_patch.v1.metrics.stats.invariants_field": ("package",),
    "vllm_patch.v1.metrics.loggers": ("package",),
    "vllm_patch.v1.structured_output.g2_accept_once": ("G2",),
    "vllm_patch.v1.structured_output.g3_rows": ("G3",),
    "vllm_patch.v1.structured_output.parallel_rows": ("package",),
    "vllm_patch.v1.structured_output.grammar_drafts": ("package",),
    "vllm_patch.v1.spec_decode.llm_base_proposer": ("package",),
    "vllm_patch.v1.worker.gpu_model_runner.g3_drafts": ("G3",),
    "vllm_patch.v1.worker.gpu_model_runner.forced_drafts": ("package",),
    "vllm_patch.v1.worker.gpu_model_runner.async_output_placeholders": ("package",),
    "vllm_patch.v1.worker.gpu_model_runner.async_output_count_align": ("package",),
    "vllm_patch.v1.worker.gpu_model_runner.cpu_seeded_prefill_rewind": ("package",),
    "vllm_patch.v1.worker.gpu_input_batch": ("package",),
    "vllm_patch.v1.worker.gpu.model_runner": ("G1", "G3", "package"),
    "vllm_patch.v1.worker.gpu.spec_decode.utils": ("G1",),
    "vllm_patch.v1.worker.gpu.spec_decode.speculator": ("package",),
    "vllm_patch.distributed.kv_transfer.kv_connector.v1.base": ("G4",),
    "vllm_patch.utils.cpu_triton_utils": ("package",),
    "vllm_patch.v1.sample.ops.topk_topp_sampler": ("package",),
    "vllm_patch.distributed.kv_transfer.kv_connector.v1.example_connector": ("package",),
}

logger = logging.getLogger("vllm_patch")


class _ToVllmLog(logging.Handler):
    """Hands "vllm_patch" records to the "vllm" logger's current handlers.

    vLLM configures only its "vllm" logger (with propagate=False) and leaves
    the root logger bare, so in a vLLM process our INFO lines were dropped and
    our warnings reached stderr unformatted through logging.lastResort. When
    the application has configured root logging itself, records propagate
    there instead and this handler stays out of the way (no duplicates).
    Before vLLM has configured its logger (plugins can load first), records
    go to stderr in vLLM's format rather than being lost.
    """

    def __init__(self) -> None:
        super().__init__()
        self._early = logging.StreamHandler()  # stderr
        self._early.setFormatter(logging.Formatter(
            "%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        target = logging.getLogger("vllm")
        if not target.handlers:
            self._early.handle(record)
        elif target.isEnabledFor(record.levelno):
            target.handle(record)


def _route_logs_to_vllm() -> None:
    """Make vllm_patch's log lines part of vLLM's log (once per process)."""
    if any(isinstance(h, _ToVllmLog) for h in logger.handlers):
        return
    try:
        import vllm.envs as vllm_envs
        import vllm.logger  # noqa: F401  (configures the "vllm" logger)
    except Exception:  # noqa: BLE001 - logging must never break register()
        return
    if not vllm_envs.VLLM_CONFIGURE_LOGGING or logger.handlers:
        return  # the user configures logging; leave "vllm_patch" alone
    logger.addHandler(_ToVllmLog())
    if logger.level == logging.NOTSET:
        # The level vLLM gives its own logger (VLLM_LOGGING_LEVEL).
        logger.setLevel(logging.getLevelName(vllm_envs.VLLM_LOGGING_LEVEL))


def load_patches() -> None:
    """Import every patch module and put its patches in the registry. A
    module that fails to import is recorded (its guarantees are then not
    enforced); it never stops vLLM from starting."""
    from vllm_patch.patching import REGISTRY

    for name, gids in PATCH_MODULES.items():
        try:
            module = importlib.import_module(name)
            patches = list(module.PATCHES)
            for patch in patches:
                REGISTRY.add(patch)
        except Exception as exc:  # noqa: BLE001 - never stop vLLM
            REGISTRY.module_errors[name] = (gids, f"{type(exc).__name__}: {exc}")
        else:
            REGISTRY.module_errors.pop(name, None)


def register() -> None:
    """Apply every verifiable patch to the installed vLLM (idempotent).

    Never raises, except for a malformed VLLM_PATCH_* variable (a clear
    configuration error) and, under VLLM_PATCH_STRICT=1, `PatchError` when a
    guarantee cannot be enforced."""
    from vllm_patch import envs, patching

    _route_logs_to_vllm()
    settings = envs.settings()
    try:
        load_patches()
        outcomes = patching.apply_all(settings)
    except patching.PatchError:
        raise
    except Exception as exc:  # noqa: BLE001 - the registry itself failed
        if settings.strict:
            raise
        logger.exception("vllm_patch: internal error while applying patches "
                         "(%s); every patch reverted, G1-G4 are NOT enforced",
                         exc)
        patching.revert_all()
        return
    applied = [o.patch.name for o in outcomes if o.state is patching.State.APPLIED]
    if settings.disable:
        # Only switches set by their own variable apply here
        # (patching.disabled).
        if getattr(register, "_said_disabled", None) != applied:
            test_only = [o.patch.name for o in outcomes
                         if o.state is patching.State.APPLIED
                         and o.patch.guarantee == "test-only"]
            fixes = [n for n in applied if n not in test_only]
            native = sorted(patching.native_guarantees())
            logger.warning(
                "vllm_patch: VLLM_PATCH_DISABLE=1, no patch applied: "
                "G1-G4 are NOT enforced by this package (stock vLLM)%s%s%s",
                "; this vLLM build enforces " + ", ".join(native) +
                " itself (patch series)" if native else "",
                "; TEST ONLY switches still on (each set by its own variable): "
                + ", ".join(test_only) if test_only else "",
                "; still on, set by their own variable: " + ", ".join(fixes)
                if fixes else "",
            )
            register._said_disabled = applied  # type: ignore[attr-defined]
        return
    if getattr(register, "_said_applied", None) != applied:
        logger.info("vllm_patch %s on vLLM %s: applied %s", __version__,
                    patching.vllm_version(), ", ".join(applied) or "nothing")
        register._said_applied = applied  # type: ignore[attr-defined]
