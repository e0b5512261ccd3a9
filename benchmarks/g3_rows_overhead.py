"""Per-row cost of the plugin's G3 row patch (`g3-bitmask-rows`, a wrapper
of `StructuredOutputManager._fill_bitmasks` that the speculative walk calls
once per row) over vLLM's own `_fill_bitmasks`, without any grammar work:
the grammar's fill is a no-op, so what is timed is the wrapper's Python
(one walk of `rows` rows per request, like the scheduler's).

Compares, interleaved per repetition in one process: vLLM's method, the
wrapper as in this checkout, and optionally an older wrapper
(`--old-source FILE`, e.g. `git show HEAD~1:vllm_patch/v1/structured_output/g3_rows.py`).
Reports microseconds per row (median over --reps) and the extra per row.

`--real VOCAB:BACKEND` times instead the scheduler's whole serial walk
(vLLM's `StructuredOutputManager.grammar_bitmask`, no threads) on real
grammars, the setting of `verify_rows_parallel.py` (B requests at random
points of MaskBench instances, k drafts each from a simulated drafter),
with `_fill_bitmasks` swapped per repetition between vLLM's, this
checkout's wrapper and the older one: milliseconds per step.

    python benchmarks/g3_rows_overhead.py --old-source /tmp/g3_rows_old.py
    python benchmarks/g3_rows_overhead.py --old-source /tmp/g3_rows_old.py \
        --real 131k:guidance --k 4 --batch 256
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class _Grammar:
    """A grammar whose fill is free (the wrapper's own cost is timed)."""

    def is_terminated(self) -> bool:
        return False

    def fill_bitmask(self, bitmask, index) -> None:
        pass


def _manager(vocab: int, rows: int):
    import torch

    words = (vocab + 31) // 32
    return SimpleNamespace(
        vllm_config=SimpleNamespace(
            num_speculative_tokens=rows - 1,
            model_config=SimpleNamespace(is_diffusion=False)),
        _grammar_bitmask=torch.full((rows * 256, words), -1, dtype=torch.int32),
        _full_mask=torch.tensor(-1, dtype=torch.int32))


def _walk(fill, manager, grammars, rows: int, extra: tuple) -> float:
    t0 = time.perf_counter()
    index = 0
    for g in grammars:
        for _ in range(rows):
            fill(manager, [(g, index, True, *extra)])
            index += 1
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rows", type=int, default=5, help="rows per request (k + 1)")
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--old-source", default=None)
    ap.add_argument("--real", default=None, metavar="VOCAB:BACKEND")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--schemas", type=int, default=64)
    args = ap.parse_args(argv)

    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_patch.v1.structured_output import g3_rows

    from vllm_patch.patching import ORIGINAL_ATTR

    # vLLM's own method (the plugin's wrapper removed, if it is applied).
    stock = StructuredOutputManager.__dict__["_fill_bitmasks"]
    stock = getattr(stock, ORIGINAL_ATTR, stock)
    modes = {"vllm": stock, "wrapper": g3_rows._make_fill_bitmasks(stock)}
    if args.old_source:
        spec = importlib.util.spec_from_file_location("_g3_rows_old", args.old_source)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)  # type: ignore[union-attr]
        modes["old wrapper"] = old._make_fill_bitmasks(stock)
    if args.real:
        return _real(args, modes, stock)
    manager = _manager(args.vocab, args.rows)
    from vllm_patch import patching

    # vLLM 0.33's entries carry the masked reasoning ends too.
    extra = ((),) if patching.version_series(patching.vllm_version()) == "0.33" \
        else ()
    grammars = [_Grammar() for _ in range(args.batch)]
    n = args.batch * args.rows
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(3):  # warm-up
        for fill in modes.values():
            _walk(fill, manager, grammars, args.rows, extra)
    for _ in range(args.reps):
        for m, fill in modes.items():
            times[m].append(_walk(fill, manager, grammars, args.rows, extra) / n * 1e6)
    base = statistics.median(times["vllm"])
    print(f"B={args.batch}, {args.rows} rows per request ({n} rows), "
          f"median of {args.reps}, modes interleaved")
    for m, ts in times.items():
        med = statistics.median(ts)
        print(f"  {m:12s} {med:6.3f} us/row  (+{med - base:5.3f} us/row, "
              f"+{(med - base) * n / 1000:6.3f} ms per step of {n} rows)")
    return 0


def _real(args: argparse.Namespace, modes: dict, stock) -> int:
    import random

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import grammar_draft_cost as gdc
    import verify_rows_parallel as vrp
    from vllm.v1.structured_output import StructuredOutputManager

    torch.set_num_threads(1)
    vocab, kind = args.real.split(":")
    world = gdc.World(vocab, kind, argparse.Namespace(schemas=args.schemas,
                                                      min_tokens=48))
    rng = random.Random(f"0:{kind}:{world.vocab}:{args.k}:{args.batch}")
    manager = vrp.managers(world, args.k, args.batch, kind)["stock"]
    reqs, ids, spec = vrp.requests(world, args.k, args.batch, rng, 0.7)
    walk = vrp.gdc._original(StructuredOutputManager.grammar_bitmask)
    rows = len(ids) + sum(len(v) for v in spec.values())
    times: dict[str, list[float]] = {m: [] for m in modes}
    masks = {}
    for rep in range(3 + args.reps):
        order = list(modes) if rep % 2 == 0 else list(reversed(modes))
        for m in order:
            type(manager)._fill_bitmasks = modes[m]
            t0 = time.perf_counter()
            masks[m] = walk(manager, reqs, ids, spec).copy()
            if rep >= 3:
                times[m].append((time.perf_counter() - t0) * 1e3)
    type(manager)._fill_bitmasks = stock
    base = statistics.median(times["vllm"])
    print(f"{vocab} {kind} k={args.k} B={args.batch} ({rows} rows), serial "
          f"walk, median of {args.reps}, modes interleaved")
    for m, ts in times.items():
        med = statistics.median(ts)
        print(f"  {m:12s} {med:7.2f} ms/step  (+{med - base:5.2f} ms, "
              f"{med / base:5.3f}x)")
    same = all((masks[m] == masks["wrapper"]).all() for m in masks
               if m != "vllm")
    print(f"  the wrappers' rows identical: {same}; equal to vLLM's (no "
          f"grammar ended in the walk): "
          f"{bool((masks['vllm'] == masks['wrapper']).all())}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
