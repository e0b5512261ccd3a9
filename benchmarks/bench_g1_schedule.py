"""Scheduler cost per step, G1 patched vs stock, in one run.

A batch of structured requests (xgrammar regex `(abc)+`, ignore_eos)
decodes with the AsyncScheduler in EngineCore's async loop at batch queue 2
(the G1 mechanism active: every step is tracked, every request has one
unapplied step at schedule time, every step is pending/deferred). Timed per
step (thread CPU time): `schedule()` + `update_from_output()` of the
previous step + `get_grammar_bitmask()` (the scheduler-side calls EngineCore
makes per step); the bitmask-free part is reported too. Fake runner outputs
are built outside the timed region.

Four real schedulers decode the same requests with the same tokens, one per
mode: "g1" = `vllm_patch.register()` (every patch), "no-g1" = every patch but
G1's (`inflight.PATCHES` reverted: the difference is the G1 mechanism's own
cost, with G2/G3 unchanged), "stock" = `patching.revert_all()`, and "stock2"
= stock again, the A/A control. They advance in lockstep, a few steps at a
time, modes rotated every block, the patch set switched (untimed, the same
registry work for every mode) before each block and the first step after
a switch left untimed, the schedulers rotated over the modes pass by pass
(see `bench_g2_update.interleaved`). Step i of one
mode is paired with step i of another; reported: medians of the per-step
times, and the median of the per-step pair ratios with a bootstrap 95 %
confidence interval for g1/no-g1 (target <= 1.01), g1/stock (everything)
and stock2/stock (the noise floor of the run).

    python benchmarks/bench_g1_schedule.py [--batch 256] [--steps 24]
        [--repeats 6] [--block 4]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_g2_update import interleaved, median_ci, pair_ratios  # noqa: E402

MODES = ("stock", "stock2", "no-g1", "g1")


def _harness(batch: int, steps: int) -> Any:
    from vllm_patch.testing.harness import Harness

    return Harness("xgrammar", async_scheduling=True, block_size=16,
                   num_blocks=batch * (4 + steps + 8) // 16 + batch + 64,
                   max_num_seqs=batch, max_model_len=1024,
                   max_num_batched_tokens=batch * 4 + 64)


class Pass:
    """One batch decoded step by step at async batch queue 2."""

    def __init__(self, h: Any, batch: int) -> None:
        from vllm_patch.v1.core.sched.scheduler import g1_inflight as inflight

        self.h = h
        # Schedulers rotate over the modes: start without G1 state from an
        # earlier pass (its FIFO is empty after finish(); this makes sure).
        h.scheduler.__dict__.pop(inflight._STATE_ATTR, None)  # noqa: SLF001
        self.cyc = [h.tok(c) for c in "abc"]
        prompt = [h.tok(c) for c in "xyzx"]
        self.rids = [h.add_request(prompt, regex="(abc)+", ignore_eos=True,
                                   max_tokens=1000) for _ in range(batch)]
        self.pos = dict.fromkeys(self.rids, 0)
        self.prev: Any = None
        self.prev_out: Any = None

    def _output(self, so: Any) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        ids = list(so.num_scheduled_tokens)
        toks = []
        for r in ids:
            toks.append([self.cyc[self.pos[r] % 3]])
            self.pos[r] += 1
        return ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=toks)

    def step(self) -> tuple[float, float]:
        """(schedule+update+bitmask, schedule+update) CPU seconds."""
        sched = self.h.scheduler
        gc.collect()
        gc.disable()
        try:
            t0 = time.thread_time()
            so = sched.schedule()
            t1 = time.thread_time()
            if self.prev is not None:
                sched.update_from_output(self.prev, self.prev_out)
            t2 = time.thread_time()
            sched.get_grammar_bitmask(so)
            t3 = time.thread_time()
        finally:
            gc.enable()
        self.prev, self.prev_out = so, self._output(so)
        return t3 - t0, t2 - t0

    def finish(self) -> None:
        sched = self.h.scheduler
        if self.prev is not None:
            sched.update_from_output(self.prev, self.prev_out)
        self.prev = None
        self.h.drain()
        for r in self.rids:
            self.h.requests.pop(r, None)
            self.h.emitted_by_req.pop(r, None)
        self.h.steps.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--block", type=int, default=4,
                    help="steps per mode between switches (first untimed)")
    args = ap.parse_args()

    import vllm_patch
    from vllm_patch import envs, patching
    from vllm_patch.v1.core.sched.scheduler import g1_inflight as inflight

    g1_names = {p.name for p in inflight.PATCHES}
    settings = envs.settings()

    def set_mode(m: str) -> None:
        # The same registry work in every mode (apply all, then revert).
        patching.apply_all(settings)
        for name in list(patching.REGISTRY.outcomes):
            if m in ("stock", "stock2") or (m == "no-g1"
                                            and name in g1_names):
                patching.revert_patch(name)

    vllm_patch.register()
    print(f"vLLM {patching.vllm_version()}; AsyncScheduler, batch queue 2, "
          f"batch {args.batch}; {args.repeats} passes x {args.steps} steps "
          f"per mode, modes interleaved in blocks of {args.block} steps "
          f"(first untimed); thread CPU time; ratio = median of per-step "
          f"pair ratios [bootstrap 95% CI]")
    harnesses = {}
    for m in MODES:
        set_mode(m)
        harnesses[m] = _harness(args.batch, args.steps)
    warm = {}
    for m in MODES:  # grammar compiler, caches
        set_mode(m)
        warm[m] = Pass(harnesses[m], min(args.batch, 16))
        for _ in range(3):
            warm[m].step()
        warm[m].finish()
    times = interleaved(harnesses, set_mode,
                        lambda h: Pass(h, args.batch), args.steps,
                        args.repeats, args.block)
    rng = random.Random(0)
    for field, label in ((0, "schedule+update+bitmask"),
                         (1, "schedule+update")):
        med = {m: statistics.median(v[field] for v in times[m].values())
               for m in MODES}
        print(f"{label}: median ms "
              + "  ".join(f"{m} {med[m] * 1e3:.3f}" for m in MODES))
        for num, den, what in (("g1", "no-g1", "G1 (g1/no-g1)"),
                               ("g1", "stock", "all patches (g1/stock)"),
                               ("stock2", "stock", "A/A (stock2/stock)")):
            r, lo, hi = median_ci(pair_ratios(times, num, den, field), rng)
            print(f"  {what:<24} {r:.4f}  [{lo:.4f}-{hi:.4f}]  "
                  f"n={len(times[den])}")
    set_mode("g1")
    vllm_patch.register()


if __name__ == "__main__":
    main()
