"""Speculative verification rows: stock's serial walk against the patched
walk on vLLM's fill threads, as the work grows.

Per cell (vocabulary x backend x k x B): B structured requests at random
points of real MaskBench (JSONSchemaBench) instances, their drafts the
document's next k tokens from a simulated drafter (right with probability
--drafter-accuracy per token, a random token after its first miss), trimmed
to their grammar-valid prefix as the scheduler trims them. The scheduler's
`StructuredOutputManager.grammar_bitmask` then fills the step's rows in
three modes, interleaved per repetition, on the same grammars (every walk
rolls its grammar back):

- stock: vLLM's own method (the plugin's wrappers removed);
- serial: the patched method with `VLLM_PATCH_PARALLEL_VERIFY=0`;
- threads: the patched method with its walk always threaded (what the
  choice avoids where threads lose);
- parallel: the patched method as shipped (threaded where its measurements
  say threads are cheaper), after --warmup steps for the choice to settle.

It reports wall time per step (the scheduler's critical path: the fill
overlaps the GPU's forward pass, so only what exceeds the forward delays a
step), CPU time of all threads (the extra CPU the threads spend), and checks
that the three modes' bitmasks are identical. vLLM's fill pool has
min(cores // 2, 8) threads, plus the engine thread: 2 lanes on this
2-core machine. `--model-cores` projects the wall time on a larger host from
the parallel efficiency measured here (a model, said so in the table).

    python benchmarks/verify_rows_parallel.py --json /tmp/verify.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grammar_draft_cost as gdc  # noqa: E402  (World, MaskBench documents)

MODES = ("stock", "serial", "threads", "parallel")
GPU_STEPS_MS = (10.0, 20.0, 30.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="verify_rows_parallel.py",
        description="Wall and CPU time of the scheduler's speculative "
                    "verification rows: stock (serial) vs patched (threads).")
    ap.add_argument("--vocabs", default="32k,131k")
    ap.add_argument("--backends", default="xgrammar,guidance")
    ap.add_argument("--batch", default="1,8,32,128,256")
    ap.add_argument("--k", default="1,4,7")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=8,
                    help="untimed steps first (the shipped choice measures "
                         "three serial and three threaded walks; default 8)")
    ap.add_argument("--schemas", type=int, default=64)
    ap.add_argument("--min-tokens", type=int, default=48)
    ap.add_argument("--drafter-accuracy", type=float, default=0.7)
    ap.add_argument("--model-cores", type=int, default=16,
                    help="project the wall time on a host with this many cores "
                         "(vLLM's pool: min(cores // 2, 8) threads; default 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="32k xgrammar, k=4, B=8,128,256, 3 reps")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.vocabs, args.backends, args.k = "32k", "xgrammar", "4"
        args.batch, args.reps, args.schemas = "8,128,256", 3, 16
    return args


def pool_threads(cores: int) -> int:
    """vLLM's `executor_for_fillmask` size (StructuredOutputManager)."""
    return max(1, min(cores // 2, 8))


def managers(world: Any, k: int, batch: int, kind: str) -> dict[str, Any]:
    import torch
    from vllm.v1.structured_output import StructuredOutputManager as M

    stock_cls = type("StockManager", (M,), {
        name: gdc._original(getattr(M, name))
        for name in ("grammar_bitmask", "_fill_bitmasks")})
    cfg = world.config("stock", k, max(batch, 129))
    pool = ThreadPoolExecutor(max_workers=pool_threads(os.cpu_count() or 1))
    out = {}
    for mode in MODES:
        m = (stock_cls if mode == "stock" else M).__new__(
            stock_cls if mode == "stock" else M)
        m.backend = world.backend
        m.reasoner_cls = None
        m.enable_in_reasoning = False
        m._grammar_bitmask = None
        m._full_mask = torch.tensor(-1, dtype=torch.int32)
        m.fill_bitmask_parallel_threshold = 128
        m.fill_bitmask_parallel_batch_size = 16
        m.executor_for_fillmask = pool
        m.tokenizer = world.tokenizer
        m._use_async_grammar_compilation = False
        m.vllm_config = cfg
        out[mode] = m
    from vllm_patch.v1.structured_output import parallel_rows

    class Always(parallel_rows.Choice):
        def threaded(self) -> bool:
            return True

    setattr(out["threads"], parallel_rows._CHOICE_ATTR, Always())
    return out


def requests(world: Any, k: int, batch: int, rng: random.Random,
             accuracy: float) -> tuple[dict[str, Any], list[str], dict[str, list[int]]]:
    from types import SimpleNamespace

    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    reqs, ids, spec = {}, [], {}
    for row in range(batch):
        schema, doc = world.docs[rng.randrange(len(world.docs))]
        g = world.backend.compile_grammar(StructuredOutputOptions.JSON, schema)
        start = rng.randrange(0, max(1, len(doc) - k - 1))
        if start:
            assert g.accept_tokens("bench", doc[:start])
        drafts = []
        for j in range(k):
            right = start + j < len(doc) and rng.random() < accuracy \
                and (not drafts or drafts[-1] == doc[start + j - 1])
            drafts.append(doc[start + j] if right else rng.randrange(world.size))
        rid = f"r{row}"
        reqs[rid] = SimpleNamespace(
            request_id=rid, use_structured_output=True, all_token_ids=[],
            structured_output_request=SimpleNamespace(
                grammar=g, reasoning_ended=None, reasoner=None))
        valid = g.validate_tokens(drafts)
        if valid:
            spec[rid] = valid
        ids.append(rid)
    return reqs, ids, spec


def run_cell(world: Any, kind: str, k: int, batch: int,
             args: argparse.Namespace) -> dict[str, Any]:
    from vllm_patch.v1.structured_output import parallel_rows

    rng = random.Random(f"{args.seed}:{kind}:{world.vocab}:{k}:{batch}")
    ms = managers(world, k, batch, kind)
    reqs, ids, spec = requests(world, k, batch, rng, args.drafter_accuracy)
    wall = {m: [] for m in MODES}
    cpu = {m: [] for m in MODES}
    identical = True
    choice = parallel_rows.choice(ms["parallel"])
    for rep in range(args.warmup + args.reps):
        masks = {}
        order = list(MODES) if rep % 2 == 0 else list(reversed(MODES))
        for mode in order:
            os.environ["VLLM_PATCH_PARALLEL_VERIFY"] = "0" if mode == "serial" else "1"
            c0, w0 = time.process_time_ns(), time.perf_counter_ns()
            bm = ms[mode].grammar_bitmask(reqs, ids, spec)
            w1, c1 = time.perf_counter_ns(), time.process_time_ns()
            masks[mode] = bm.copy()
            if rep >= args.warmup:
                wall[mode].append((w1 - w0) / 1e6)
                cpu[mode].append((c1 - c0) / 1e6)
        identical &= all((masks[m] == masks["stock"]).all() for m in MODES)
    os.environ.pop("VLLM_PATCH_PARALLEL_VERIFY", None)
    ms["stock"].executor_for_fillmask.shutdown(wait=True)
    med = {m: statistics.median(v) for m, v in wall.items()}
    cmed = {m: statistics.median(v) for m, v in cpu.items()}
    c = choice.per_row
    parallel_steps = bool(c[True]) and bool(c[False]) and \
        statistics.median(c[True]) < statistics.median(c[False])
    rows = sum(1 + len(spec.get(r, ())) for r in ids)
    here = 1 + pool_threads(os.cpu_count() or 1)
    # Amdahl's law from the always-threaded lane measured here: the share
    # of the walk that holds the GIL (serial) against the rest, carried to
    # a larger host's lanes (a model: no such host here). The shipped
    # choice takes the cheaper of serial and threaded.
    s2 = med["serial"] / max(med["threads"], 1e-9)
    gil = min(1.0, max(0.0, (here / max(s2, 1e-9) - 1) / max(here - 1, 1)))
    lanes_big = 1 + pool_threads(args.model_cores)
    big = min(med["serial"], med["serial"] * (gil + (1 - gil) / lanes_big))
    cell = {
        "vocab": world.vocab, "backend": kind, "k": k, "batch": batch,
        "rows": rows, "wall_ms": med, "cpu_ms": cmed, "identical": identical,
        "threaded": bool(parallel_steps), "lanes_here": here,
        "modelled_cores": args.model_cores, "gil_share": gil,
        "modelled_parallel_ms": big,
        "step_ratio": {},
    }
    for gpu in GPU_STEPS_MS:
        stock_step = max(gpu, med["stock"])
        cell["step_ratio"][f"{gpu:g}ms"] = {
            "here": round(stock_step / max(gpu, med["parallel"]), 3),
            "modelled": round(max(gpu, med["stock"]) / max(gpu, big), 3),
        }
    return cell


def table(cells: list[dict[str, Any]]) -> str:
    head = ("| vocab | backend | k | B | rows | wall ms: stock / serial / threads / "
            "default | default vs stock | CPU ms: stock / default | identical "
            "| step tok/s vs stock @20 ms: here / modelled |")
    lines = [head, "|" + "---|" * 10]
    for c in cells:
        w, cp, r = c["wall_ms"], c["cpu_ms"], c["step_ratio"]["20ms"]
        lines.append(
            f"| {c['vocab']} | {c['backend']} | {c['k']} | {c['batch']} | "
            f"{c['rows']} | {w['stock']:.2f} / {w['serial']:.2f} / "
            f"{w['threads']:.2f} / {w['parallel']:.2f} | {w['stock'] / max(w['parallel'], 1e-9):.2f}x"
            f"{' threaded' if c['threaded'] else ' (serial)'} | "
            f"{cp['stock']:.2f} / {cp['parallel']:.2f} | "
            f"{'yes' if c['identical'] else 'NO'} | "
            f"{r['here']:.2f}x / {r['modelled']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.pop("VLLM_PATCH_DISABLE", None)
    import torch

    import vllm_patch

    torch.set_num_threads(1)
    vllm_patch.register()
    cells = []
    wargs = argparse.Namespace(schemas=args.schemas, min_tokens=args.min_tokens)
    vocabs = [v for v in args.vocabs.split(",") if v]
    backends = [b for b in args.backends.split(",") if b]
    ks = [int(x) for x in args.k.split(",")]
    batches = [int(x) for x in args.batch.split(",")]
    total = len(vocabs) * len(backends) * len(ks) * len(batches)
    for vocab in vocabs:
        for kind in backends:
            try:
                world = gdc.World(vocab, kind, wargs)
            except LookupError as exc:
                gdc.log(f"skip {vocab} {kind}: {exc}")
                continue
            for k in ks:
                for b in batches:
                    cell = run_cell(world, kind, k, b, args)
                    cells.append(cell)
                    gdc.log(f"[{len(cells)}/{total}] {vocab} {kind} k={k} B={b}: "
                            f"stock {cell['wall_ms']['stock']:.2f} ms, parallel "
                            f"{cell['wall_ms']['parallel']:.2f} ms")
    print(table(cells))
    print(f"\nwall time per step, median of {args.reps}; modes interleaved; "
          f"'here': this machine ({os.cpu_count()} cores, "
          f"{1 + pool_threads(os.cpu_count() or 1)} lanes); 'modelled': "
          f"{args.model_cores} cores ({1 + pool_threads(args.model_cores)} lanes) "
          f"by Amdahl's law from the GIL-held share measured here; a step is "
          f"max(GPU forward, rows' wall time): the fill overlaps the forward")
    if not all(c["identical"] for c in cells):
        print("error: a mode's bitmask differs from stock's", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "cells": cells},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
