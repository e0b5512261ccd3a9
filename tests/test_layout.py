"""The layout is part of the contract (README, "Where things are"): a patch
of vLLM module vllm.X.Y is defined in vllm_patch.X.Y, or in a per-guarantee
file vllm_patch.X.Y.gN_* that holds only patches of guarantee GN; production
modules never import the test tooling."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys

import pytest

import vllm_patch
from vllm_patch import patching

pytestmark = pytest.mark.unit

# Test and validation tooling: the test helpers, and the conformance
# scenarios behind `vllm-patch verify` (they drive the harness).
TOOLING = ("vllm_patch.testing", "vllm_patch.conformance")


def production_modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(vllm_patch.__path__, "vllm_patch."):
        if not info.name.startswith(TOOLING):
            names.append(info.name)
    return sorted(names)


def test_production_never_imports_test_tooling():
    names = production_modules()
    assert "vllm_patch.launch.deployment" in names and "vllm_patch.cli" in names
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m.startswith("
        f"{TOOLING!r}))\n"
        "print(','.join(bad))\n"
    )
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    res = subprocess.run([sys.executable, "-c", code], env=env, text=True,
                         capture_output=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1:] in ([], [""]), (
        f"production modules loaded {res.stdout.strip()}")


def test_every_patch_lives_where_its_vllm_module_is():
    vllm_patch.load_patches()
    assert patching.REGISTRY.patches
    for patch in patching.REGISTRY.patches.values():
        mirror = "vllm_patch." + patch.module_name.removeprefix("vllm.")
        where = patch.defined_in
        leaf = where.removeprefix(mirror + ".")
        assert where == mirror or (leaf != where and "." not in leaf), (
            f"{patch.name} (target {patch.target}) is defined in {where}, "
            f"not in {mirror}")
        if leaf != where and leaf[:1] == "g" and leaf[1:2].isdigit():
            assert patch.guarantee == "G" + leaf[1], (
                f"{patch.name} ({patch.guarantee}) is in {where}")


def test_every_patch_module_is_registered():
    """A module that defines PATCHES but is missing from PATCH_MODULES would
    never be applied."""
    import importlib

    for name in production_modules():
        module = importlib.import_module(name)
        if hasattr(module, "PATCHES"):
            assert name in vllm_patch.PATCH_MODULES, name
