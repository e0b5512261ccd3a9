"""Scheduler update cost per step, G2 patched vs stock, in one run.

For each batch size (1/32/256), k (3/7) and kind (structured: a regex that
never ends within the run; unstructured), a real scheduler
(vllm_patch.testing.harness) decodes N steps in which every draft is
accepted (k+1 tokens per request per step: the patch's most expensive case,
since the whole step goes through the grammar). Timed: `update_from_output`
plus the sync `update_draft_token_ids` (the scheduler's per-step result
processing); scheduling, the bitmask and building the fake runner output are
not timed.

Built for a loaded, shared box: time is the thread's CPU time (other
processes' load does not count); one scheduler per (batch, k); patched and
stock batches of identical shape alternate in ABBA order over the
repetitions (`vllm_patch.patching.revert_all()` / `apply_all()` between
them); step i of a patched batch is paired with step i of the adjacent
stock batch (same lengths, same block boundaries). GC is collected before
and disabled during each batch. Reported: the medians of all stock and all
patched steps, the median of the per-pair ratios (patched / stock) and
their interquartile range. `--guarantees G2` (default) compares the G2
patches only; `all` every applicable patch.

    python benchmarks/bench_g2_update.py [--steps 24] [--repeats 6]
        [--batches 1,32,256] [--ks 3,7] [--backend xgrammar]

For vLLM 0.33 run it again with
`VLLM_TARGET_DEVICE=cpu PYTHONPATH=/root/.cache/vllm-patch/vllm-0.33.0`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from itertools import count

_SEQ = count()


def _harness(backend: str, batch: int, k: int, steps: int, repeats: int):
    from vllm_patch.testing.harness import Harness

    per_run = batch * (4 + (steps + 2) * (k + 1))
    return Harness(backend, num_spec_tokens=k, block_size=16,
                   num_blocks=per_run // 16 + batch * 4 + 64,
                   max_num_seqs=max(batch, 1), max_model_len=1024,
                   max_num_batched_tokens=batch * (k + 1) + 64,
                   enable_prefix_caching=False)


def _run(h, batch: int, k: int, structured: bool, steps: int) -> list[float]:
    """CPU seconds (this thread) of each timed step of one fresh batch."""
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    cyc = [h.tok(c) for c in "abc"]
    prompt = [h.tok(c) for c in "xyzx"]
    kw = dict(regex="(abc)+", ignore_eos=True) if structured else \
        dict(ignore_eos=True)
    rids = [h.add_request(prompt, max_tokens=1000, **kw) for _ in range(batch)]
    pos = {r: 0 for r in rids}

    def nxt(r: str, n: int) -> list[int]:
        return [cyc[(pos[r] + i) % 3] for i in range(n)]

    times = []
    gc.collect()
    gc.disable()
    try:
        for step in range(steps + 1):
            so = h.scheduler.schedule()
            if structured:
                h.scheduler.get_grammar_bitmask(so)  # as the engine does
            ids = list(so.num_scheduled_tokens)
            sampled = []
            for r in ids:
                n = 1 + len(so.scheduled_spec_decode_tokens.get(r, ()))
                sampled.append(nxt(r, n))
                pos[r] += n
            out = ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled)
            drafts = DraftTokenIds(ids, [nxt(r, k) for r in ids])
            t0 = time.thread_time()
            h.scheduler.update_from_output(so, out)
            h.scheduler.update_draft_token_ids(drafts)
            dt = time.thread_time() - t0
            if step:  # step 0 is the prefill
                times.append(dt)
    finally:
        gc.enable()
    for r in rids:
        req = h.request(r)
        assert not req.is_finished(), (r, req.status)  # full steps throughout
    h.drain()
    for r in rids:  # keep the harness' bookkeeping small
        h.requests.pop(r)
        h.emitted_by_req.pop(r)
    h.steps.clear()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--ks", default="3,7")
    ap.add_argument("--backend", default="xgrammar")
    ap.add_argument("--guarantees", default="G2",
                    help="patches compared against stock: those of these "
                         "guarantees (comma-separated), 'all', or 'none' "
                         "(an A/A run: the noise floor of this box)")
    args = ap.parse_args()

    import vllm_patch
    from vllm_patch import envs, patching

    wanted = None if args.guarantees == "all" else \
        set(args.guarantees.split(","))

    def mode(patched: bool) -> None:
        # Both modes do the same registry work (apply, then revert), so
        # neither pays for allocations the other does not.
        patching.apply_all(settings)
        for name, outcome in list(patching.REGISTRY.outcomes.items()):
            if not patched or (wanted is not None
                               and outcome.patch.guarantee not in wanted):
                patching.revert_patch(name)

    vllm_patch.register()
    settings = envs.settings()
    mode(True)
    applied = sorted(n for n, o in patching.REGISTRY.outcomes.items()
                     if o.state is patching.State.APPLIED)

    print(f"vLLM {patching.vllm_version()}, {args.backend}; per-step "
          f"update_from_output + update_draft_token_ids; {args.repeats} "
          f"batches x {args.steps} steps, ABBA batches, "
          f"step i paired with step i; ratio = median of pair ratios; patched = "
          f"{', '.join(applied)}")
    print(f"{'batch':>5} {'k':>2} {'kind':>12} {'stock us':>9} "
          f"{'patched us':>10} {'ratio':>6}  {'IQR':<11}")
    for batch in map(int, args.batches.split(",")):
        for k in map(int, args.ks.split(",")):
            h = _harness(args.backend, batch, k, args.steps, args.repeats)
            for structured in (True, False):
                mode(False)
                _run(h, batch, k, structured, 3)  # warm-up, both paths
                mode(True)
                _run(h, batch, k, structured, 3)
                pairs: list[tuple[float, float]] = []
                for rep in range(args.repeats):
                    got = {}
                    for patched in ((False, True) if rep % 2 == 0
                                    else (True, False)):
                        mode(patched)
                        got[patched] = _run(h, batch, k, structured,
                                            args.steps)
                    pairs += zip(got[False], got[True])
                mode(True)
                ratios = sorted(p / s for s, p in pairs)
                q = statistics.quantiles(ratios, n=4)
                s = statistics.median(x for x, _ in pairs) * 1e6
                p = statistics.median(y for _, y in pairs) * 1e6
                kind = "structured" if structured else "unstructured"
                print(f"{batch:>5} {k:>2} {kind:>12} {s:>9.1f} {p:>10.1f} "
                      f"{statistics.median(ratios):>6.3f}  "
                      f"{q[0]:.3f}-{q[2]:.3f}", flush=True)
            h.drain()


if __name__ == "__main__":
    main()
