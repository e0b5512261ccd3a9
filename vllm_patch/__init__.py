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

# Modules that define patches, each exposing PATCHES: list[Patch]. A patch for
# vLLM module vllm.X.Y lives in vllm_patch.X.Y.
PATCH_MODULES: tuple[str, ...] = (
)

logger = logging.getLogger("vllm_patch")


def load_patches() -> None:
    """Import every patch module and put its patches in the registry."""
    from vllm_patch.patching import REGISTRY

    for name in PATCH_MODULES:
        module = importlib.import_module(name)
        for patch in module.PATCHES:
            REGISTRY.add(patch)


def register() -> None:
    """Apply every verifiable patch to the installed vLLM (idempotent)."""
    from vllm_patch import envs, patching

    settings = envs.settings()
    load_patches()
    outcomes = patching.apply_all(settings)
    if settings.disable:
        if not getattr(register, "_said_disabled", False):
            logger.warning(
                "vllm_patch: VLLM_PATCH_DISABLE=1, no patch applied: "
                "G1-G4 are NOT enforced (stock vLLM)"
            )
            register._said_disabled = True  # type: ignore[attr-defined]
        return
    applied = [o.patch.name for o in outcomes if o.state is patching.State.APPLIED]
    logger.info("vllm_patch %s on vLLM %s: applied %s", __version__,
                patching.vllm_version(), ", ".join(applied) or "nothing")
