"""Scheduler cost per step, G1 patched vs stock, in one run.

Batch of structured requests (xgrammar regex `(abc)+`, ignore_eos) decoding
with the AsyncScheduler in EngineCore's async loop at batch queue 2 (the
G1 mechanism active: every step is tracked, every request has one unapplied
step at schedule time, every step is pending/deferred). Timed per step:
`schedule()` + `update_from_output()` of the previous step +
`get_grammar_bitmask()` (the scheduler-side calls EngineCore makes per
step); the bitmask-free part is reported too. Fake runner outputs are built
outside the timed region. Three modes alternate in the same process,
repetition by repetition (order rotated): "g1" = `vllm_patch.register()`
(every patch), "no-g1" = every patch but G1's (`revert_patch` of
`inflight.PATCHES`: the G1 mechanism's own cost, with G2/G3 unchanged),
"stock" = `patching.revert_all()`. Medians of all per-step times.

    python benchmarks/bench_g1_schedule.py [--batch 256] [--steps 30] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _measure(batch: int, steps: int) -> tuple[list[float], list[float]]:
    from vllm.v1.outputs import ModelRunnerOutput

    from vllm_patch.testing.harness import Harness

    h = Harness("xgrammar", async_scheduling=True, block_size=16,
                num_blocks=batch * (4 + steps + 4) // 16 + 64,
                max_num_seqs=batch, max_model_len=1024,
                max_num_batched_tokens=batch * 4 + 64)
    sched = h.scheduler
    cyc = [h.tok(c) for c in "abc"]
    prompt = [h.tok(c) for c in "xyzx"]
    rids = [h.add_request(prompt, regex="(abc)+", ignore_eos=True,
                          max_tokens=1000) for _ in range(batch)]
    pos = dict.fromkeys(rids, 0)

    def output(so):
        ids = list(so.num_scheduled_tokens)
        toks = []
        for r in ids:
            toks.append([cyc[pos[r] % 3]])
            pos[r] += 1
        return ModelRunnerOutput(req_ids=ids,
                                 req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=toks)

    total, no_mask = [], []
    prev = prev_out = None
    for step in range(steps + 2):
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        if prev is not None:
            sched.update_from_output(prev, prev_out)
        t2 = time.perf_counter()
        sched.get_grammar_bitmask(so)
        t3 = time.perf_counter()
        prev, prev_out = so, output(so)
        if step >= 2:  # prefill and first decode excluded
            total.append(t3 - t0)
            no_mask.append((t1 - t0) + (t2 - t1))
    h.drain()
    return total, no_mask


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import vllm_patch
    from vllm_patch import patching

    from vllm_patch.v1.core.sched import inflight

    vllm_patch.register()
    print(f"vLLM {patching.vllm_version()}; async queue 2, batch {args.batch}, "
          f"{args.steps} steps x {args.repeats} repeats (interleaved)")
    modes = ["g1", "no-g1", "stock"]
    res = {m: ([], []) for m in modes}
    _measure(min(args.batch, 16), 3)  # warm-up (grammar compiler, caches)
    for rep in range(args.repeats):
        for m in modes[rep % 3:] + modes[:rep % 3]:
            vllm_patch.register()
            if m == "no-g1":
                for p in inflight.PATCHES:
                    patching.revert_patch(p.name)
            elif m == "stock":
                patching.revert_all()
            total, no_mask = _measure(args.batch, args.steps)
            res[m][0].extend(total)
            res[m][1].extend(no_mask)
    vllm_patch.register()
    for i, label in enumerate(("schedule+update+bitmask", "schedule+update")):
        for stat in ("median", "p10"):
            if stat == "median":
                val = {m: statistics.median(res[m][i]) * 1e3 for m in modes}
            else:  # less sensitive to other processes on a shared machine
                val = {m: statistics.quantiles(res[m][i], n=10)[0] * 1e3
                       for m in modes}
            print(f"{label:<24} {stat:<6} "
                  + "  ".join(f"{m} {val[m]:7.3f} ms" for m in modes)
                  + f"  G1 ratio (g1/no-g1) {val['g1'] / val['no-g1']:.4f}"
                  f"  all/stock {val['g1'] / val['stock']:.4f}")


if __name__ == "__main__":
    main()
