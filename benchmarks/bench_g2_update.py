"""Scheduler update cost per step, G2 patched vs stock, in one run.

For each batch size (1/32/256), k (3/7) and kind (structured: xgrammar regex
that never ends within the run; unstructured), a fresh real scheduler
(vllm_patch.testing.harness) decodes N steps in which every draft is
accepted (k+1 tokens per request per step: the patch's most expensive case,
since the whole step is validated). Timed: `update_from_output` plus the
sync `update_draft_token_ids` (the scheduler's per-step result processing);
scheduling, bitmask and building the fake runner output are not timed.
Patched and stock alternate in the same process (vllm_patch.patching
.revert_all() / vllm_patch.register()); the median of the per-step times is
compared.

    python benchmarks/bench_g2_update.py [--steps 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _measure(batch: int, k: int, structured: bool, steps: int) -> list[float]:
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    from vllm_patch.testing.harness import Harness

    h = Harness("xgrammar", num_spec_tokens=k, block_size=16,
                num_blocks=batch * (4 + (steps + 2) * (k + 1)) // 16 + 64,
                max_num_seqs=max(batch, 1), max_model_len=1024,
                max_num_batched_tokens=batch * (k + 1) + 64)
    cyc = [h.tok(c) for c in "abc"]
    prompt = [h.tok(c) for c in "xyzx"]
    kw = dict(regex="(abc)+", ignore_eos=True) if structured else {}
    rids = [h.add_request(prompt, max_tokens=1000, **kw) for _ in range(batch)]
    pos = {r: 0 for r in rids}

    def nxt(r: str, n: int) -> list[int]:
        return [cyc[(pos[r] + i) % 3] for i in range(n)]

    times = []
    for step in range(steps + 1):
        so = h.schedule()
        h._grammar(so)  # noqa: SLF001 - bitmask as the engine computes it
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for r in ids:
            n = 1 + len(so.scheduled_spec_decode_tokens.get(r, ()))
            sampled.append(nxt(r, n))
            pos[r] += n
        out = ModelRunnerOutput(req_ids=ids,
                                req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled)
        drafts = DraftTokenIds(ids, [nxt(r, k) for r in ids])
        t0 = time.perf_counter()
        h.scheduler.update_from_output(so, out)
        h.scheduler.update_draft_token_ids(drafts)
        dt = time.perf_counter() - t0
        if step:  # step 0 is the prefill
            times.append(dt)
    h.drain()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--ks", default="3,7")
    args = ap.parse_args()

    import vllm_patch
    from vllm_patch import patching

    vllm_patch.register()
    print(f"vLLM {patching.vllm_version()}; per-step update_from_output + "
          f"update_draft_token_ids, median of {args.steps} steps x "
          f"{args.repeats} repeats")
    print(f"{'batch':>5} {'k':>2} {'kind':>12} {'stock us':>10} "
          f"{'patched us':>10} {'ratio':>6}")
    for batch in map(int, args.batches.split(",")):
        for k in map(int, args.ks.split(",")):
            for structured in (True, False):
                res: dict[bool, list[float]] = {True: [], False: []}
                for _ in range(args.repeats):
                    for patched in (False, True):
                        if patched:
                            vllm_patch.register()
                        else:
                            patching.revert_all()
                        res[patched] += _measure(batch, k, structured, args.steps)
                vllm_patch.register()
                s = statistics.median(res[False]) * 1e6
                p = statistics.median(res[True]) * 1e6
                kind = "structured" if structured else "unstructured"
                print(f"{batch:>5} {k:>2} {kind:>12} {s:>10.1f} {p:>10.1f} "
                      f"{p / s:>6.3f}", flush=True)


if __name__ == "__main__":
    main()
