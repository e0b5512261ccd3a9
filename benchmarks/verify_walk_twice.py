"""Stock vLLM's verification walk, timed twice a step: as the step meets it
and again right after, on the same grammar states and rows (the second walk
must write the same rows). Tells whether a verification row's price is the
caches' temperature (the step's drafting work runs between two walks) or
the grammar library's fill itself; with --profile, where one walk's time
goes. The cost benchmark's world (MaskBench documents, a simulated
drafter, stock's and the always-on lane interleaved), thread CPU, one core.

    python benchmarks/verify_walk_twice.py --vocabs 131k --backends xgrammar --k 4 --batch 256
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grammar_draft_cost as bench  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    profile = "--profile" in argv
    if profile:
        argv.remove("--profile")
    args = bench.parse_args(argv)
    if "," in args.vocabs + args.backends + args.k + args.batch:
        raise SystemExit("one cell: a single --vocabs, --backends, --k and --batch")
    import torch

    import vllm_patch

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    for flag in bench.FLAGS:
        os.environ.pop(flag, None)
    os.environ.pop("VLLM_PATCH_DISABLE", None)
    torch.set_num_threads(1)
    vllm_patch.register()
    bench._time_compiles()
    bench._feed_step_times()
    world = bench.World(args.vocabs, args.backends, args)
    manager = world.managers["stock"]
    walk = manager.grammar_bitmask
    first: list[float] = []
    second: list[float] = []
    top: list[str] = []

    def twice(requests, ids, spec):
        rows = len(ids) + sum(len(v) for v in spec.values())
        t0 = time.thread_time_ns()
        out = walk(requests, ids, spec).copy()
        t1 = time.thread_time_ns()
        if profile and len(first) == args.warmup and not top:
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            walk(requests, ids, spec)
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(8)
            top.append(buf.getvalue())
            t1 = time.thread_time_ns()
        again = walk(requests, ids, spec)
        t2 = time.thread_time_ns()
        if not (out == again).all():
            raise AssertionError("the second walk wrote other rows")
        first.append((t1 - t0) / rows / 1e3)
        second.append((t2 - t1) / rows / 1e3)
        return again

    manager.grammar_bitmask = twice
    bench.run_cell(world, int(args.k), int(args.batch), args, modes=("stock", "always"))
    a, b = first[args.warmup:], second[args.warmup:]
    print(f"{args.vocabs} {args.backends}, k={args.k}, B={args.batch}: stock's walk per "
          f"row (median of {len(a)} steps) {statistics.median(a):.1f} us as the step "
          f"meets it, {statistics.median(b):.1f} us again right after; rows identical")
    if top:
        print(top[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
