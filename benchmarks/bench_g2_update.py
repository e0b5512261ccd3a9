"""Scheduler update cost per step, G2 patched vs stock, in one run.

For each batch size (1/32/256), k (3/7) and kind (structured: a regex that
never ends within the run; unstructured), three real schedulers
(vllm_patch.testing.harness) decode the same requests with the same tokens:
"stock", "stock2" (stock again: the A/A control) and "patched". Every draft
is accepted (k+1 tokens per request per step: the patch's most expensive
case, since the whole step goes through the grammar). Timed: the
scheduler's per-step result processing, `update_from_output` plus the sync
`update_draft_token_ids`; scheduling, the bitmask and building the fake
runner output are not timed.

Built for a loaded, shared 2-core box:
- time is the thread's CPU time (time spent descheduled does not count);
- the three schedulers advance in lockstep, a few steps at a time
  (`--block`, default 4), in an order rotated every block; the patch set
  is switched (`patching.apply_all()` / `revert_patch()`, untimed; the same
  registry work in every mode) before each block, and the first step after
  a switch is run but not timed, so step i of the three modes is measured
  within milliseconds of each other: load bursts hit all three alike;
- the schedulers rotate over the modes pass by pass (no mode keeps one
  scheduler's memory layout);
- step i of "patched" is paired with step i of "stock" (identical work:
  same lengths, same block boundaries); the A/A pair is step i of "stock2"
  with step i of "stock";
- GC is collected before and disabled during each timed call.

Reported per configuration: medians of all per-step times, the median of
the per-step pair ratios with a bootstrap 95 % confidence interval, and
the same for the A/A pair (the noise floor of the run: a ratio is resolved
only to about the width of the A/A interval).

    python benchmarks/bench_g2_update.py [--steps 16] [--repeats 8] [--block 4]
        [--batches 1,32,256] [--ks 3,7] [--backend xgrammar]
        [--guarantees G2|all]

`--guarantees G2` (default) compares the G2 patches only; `all` every
applicable patch (G1-G4). For vLLM 0.33 run it again with
`VLLM_TARGET_DEVICE=cpu PYTHONPATH=$HOME/.cache/vllm-patch/vllm-0.33.0`.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Any, Callable

MODES = ("stock", "stock2", "patched")


def _harness(backend: str, batch: int, k: int, steps: int) -> Any:
    from vllm_patch.testing.harness import Harness

    per_run = batch * (4 + (steps + 2) * (k + 1))
    return Harness(backend, num_spec_tokens=k, block_size=16,
                   num_blocks=per_run // 16 + batch * 4 + 64,
                   max_num_seqs=max(batch, 1), max_model_len=1024,
                   max_num_batched_tokens=batch * (k + 1) + 64,
                   enable_prefix_caching=False)


class Pass:
    """One batch of requests decoded step by step on one harness."""

    def __init__(self, h: Any, batch: int, k: int, structured: bool) -> None:
        self.h, self.k, self.structured = h, k, structured
        self.cyc = [h.tok(c) for c in "abc"]
        prompt = [h.tok(c) for c in "xyzx"]
        kw = dict(regex="(abc)+", ignore_eos=True) if structured else \
            dict(ignore_eos=True)
        self.rids = [h.add_request(prompt, max_tokens=1000, **kw)
                     for _ in range(batch)]
        self.pos = dict.fromkeys(self.rids, 0)

    def _next(self, r: str, n: int) -> list[int]:
        p, cyc = self.pos[r], self.cyc
        return [cyc[(p + i) % 3] for i in range(n)]

    def step(self) -> float:
        """Schedule, then time the result processing of one step (CPU s)."""
        from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

        sched = self.h.scheduler
        so = sched.schedule()
        if self.structured:
            sched.get_grammar_bitmask(so)  # as the engine does
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for r in ids:
            n = 1 + len(so.scheduled_spec_decode_tokens.get(r, ()))
            sampled.append(self._next(r, n))
            self.pos[r] += n
        out = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled)
        drafts = DraftTokenIds(ids, [self._next(r, self.k) for r in ids])
        gc.collect()
        gc.disable()
        try:
            t0 = time.thread_time()
            sched.update_from_output(so, out)
            sched.update_draft_token_ids(drafts)
            return time.thread_time() - t0
        finally:
            gc.enable()

    def finish(self) -> None:
        h = self.h
        for r in self.rids:
            req = h.request(r)
            assert not req.is_finished(), (r, req.status)  # full steps only
        h.drain()
        for r in self.rids:  # keep the harness' bookkeeping small
            h.requests.pop(r)
            h.emitted_by_req.pop(r)
        h.steps.clear()


def median_ci(values: list[float], rng: random.Random,
              n_boot: int = 1000) -> tuple[float, float, float]:
    """Median and a bootstrap 95 % confidence interval of the median."""
    med = statistics.median(values)
    boots = sorted(statistics.median(rng.choices(values, k=len(values)))
                   for _ in range(n_boot))
    return med, boots[int(0.025 * n_boot)], boots[int(0.975 * n_boot) - 1]


def interleaved(harnesses: dict[str, Any], set_mode: Callable[[str], None],
                make_pass: Callable[[Any], Any], steps: int, repeats: int,
                block: int = 4) -> dict[str, dict[tuple[int, int], Any]]:
    """Per-step times of each mode: {mode: {(pass, step): time}}.

    Each mode's scheduler runs `block` steps after each switch, modes in an
    order rotated every block, and the harnesses rotated over the modes
    every pass; the first step after a switch is run but not timed (it re-specializes the interpreter's caches after the class
    attributes changed), so every mode leaves out the same step indices and
    step i of one mode pairs with step i of another."""
    times: dict[str, dict[tuple[int, int], Any]] = {m: {} for m in harnesses}
    modes = list(harnesses)
    pool = list(harnesses.values())
    for rep in range(repeats):
        passes = {}
        for i, m in enumerate(modes):
            set_mode(m)
            # Harnesses rotate over the modes pass by pass, so no mode keeps
            # one scheduler's memory layout (the A/A pair sees the same).
            passes[m] = make_pass(pool[(i + rep) % len(pool)])
            passes[m].step()  # the prefill (and, async, the first decode)
        done = 0
        blk = 0
        while done < steps:
            n = min(block, steps - done)
            shift = (rep + blk) % len(modes)
            for m in modes[shift:] + modes[:shift]:
                set_mode(m)
                for j in range(n):
                    dt = passes[m].step()
                    if j:
                        times[m][(rep, done + j)] = dt
            done += n
            blk += 1
        for m in modes:
            set_mode(m)
            passes[m].finish()
    return times


def pair_ratios(times: dict[str, dict[tuple[int, int], Any]], num: str,
                den: str, field: int | None = None) -> list[float]:
    """Per-step ratios num/den over the steps both modes timed."""
    a, b = times[num], times[den]
    if field is None:
        return [a[key] / b[key] for key in b if key in a]
    return [a[key][field] / b[key][field] for key in b if key in a]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--block", type=int, default=4,
                    help="steps per mode between switches (first untimed)")
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--ks", default="3,7")
    ap.add_argument("--backend", default="xgrammar")
    ap.add_argument("--guarantees", default="G2",
                    help="patches compared against stock: those of these "
                         "guarantees (comma-separated) or 'all'")
    args = ap.parse_args()

    import vllm_patch
    from vllm_patch import envs, patching

    wanted = None if args.guarantees == "all" else \
        set(args.guarantees.split(","))
    settings = envs.settings()

    def set_mode(m: str) -> None:
        # Every mode does the same registry work (apply all, then revert),
        # also when the mode does not change, so every timed step follows
        # the same class-attribute churn (type caches invalidated alike).
        patched = m == "patched"
        patching.apply_all(settings)
        for name, outcome in list(patching.REGISTRY.outcomes.items()):
            if not patched or (wanted is not None
                               and outcome.patch.guarantee not in wanted):
                patching.revert_patch(name)

    vllm_patch.register()
    set_mode("patched")
    applied = sorted(n for n, o in patching.REGISTRY.outcomes.items()
                     if o.state is patching.State.APPLIED)
    rng = random.Random(0)
    print(f"vLLM {patching.vllm_version()}, {args.backend}; per-step "
          f"update_from_output + update_draft_token_ids (thread CPU time); "
          f"{args.repeats} passes x {args.steps} steps per mode, modes "
          f"interleaved in blocks of {args.block} steps (first untimed); "
          f"ratio = median of per-step pair "
          f"ratios [bootstrap 95% CI]; A/A = stock2/stock; patched = "
          f"{', '.join(applied)}")
    print(f"{'batch':>5} {'k':>2} {'kind':>12} {'stock us':>9} "
          f"{'patched us':>10} {'ratio':>6} {'95% CI':<13} "
          f"{'A/A':>6} {'A/A 95% CI':<13}")
    for batch in map(int, args.batches.split(",")):
        for k in map(int, args.ks.split(",")):
            harnesses = {}
            for m in MODES:
                set_mode(m)
                harnesses[m] = _harness(args.backend, batch, k, args.steps)
            for structured in (True, False):
                times = interleaved(
                    harnesses, set_mode,
                    lambda h: Pass(h, batch, k, structured),
                    args.steps, args.repeats, args.block)
                st = list(times["stock"].values())
                pa = list(times["patched"].values())
                r, lo, hi = median_ci(
                    pair_ratios(times, "patched", "stock"), rng)
                ra, alo, ahi = median_ci(
                    pair_ratios(times, "stock2", "stock"), rng)
                kind = "structured" if structured else "unstructured"
                print(f"{batch:>5} {k:>2} {kind:>12} "
                      f"{statistics.median(st) * 1e6:>9.1f} "
                      f"{statistics.median(pa) * 1e6:>10.1f} {r:>6.3f} "
                      f"{lo:.3f}-{hi:.3f}   {ra:>6.3f} {alo:.3f}-{ahi:.3f}",
                      flush=True)
            for m in MODES:
                set_mode(m)
                harnesses[m].drain()
            del harnesses
            gc.collect()
    set_mode("patched")


if __name__ == "__main__":
    main()
