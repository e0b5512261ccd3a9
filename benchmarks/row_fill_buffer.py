"""What a verification row costs depending on where it is written.

vLLM's scheduler fills each structured request's k + 1 verification rows
into the batch's bitmask (B x (k + 1) rows of V/32 int32 words: about
20 MB at B=256, k=4 and a 131k vocabulary). Reusing rows a drafter filled
would fill them into a small per-request buffer and copy them over. This
times both on the same grammar states (MaskBench documents, xgrammar's
matcher under vLLM's grammar, each request k drafts along its document),
the two alternated, thread CPU time, one core:

- batch bitmask: fill row j, accept draft j, ..., the bonus row, roll back;
- small buffer + copy: the same fills into a [k + 1, V/32] buffer, then one
  copy into the batch bitmask.

Both run warm (the same states again and again); the difference measured
is where the row is written, not the caches' temperature.

    python benchmarks/row_fill_buffer.py --vocab 131k --batch 256 --k 4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCABS = {"32k": "spm", "131k": "tekken"}


def documents(backend, tokenizer, count: int, min_tokens: int) -> list[tuple[str, list[int]]]:
    from vllm_patch.testing.jsonschemabench import MASKBENCH, MISSING, maskbench_entries
    from vllm_patch.v1.spec_decode.forced_drafts import vocab_for

    if not MASKBENCH.is_dir():
        raise SystemExit(MISSING)
    out = []
    for spec, g, valid in maskbench_entries(backend):
        text = json.dumps(valid[0], separators=(",", ":"), ensure_ascii=False)
        ids = vocab_for(g, tokenizer).encode_after(text)
        if ids and len(ids) >= min_tokens and len(g.validate_tokens(ids)) == len(ids):
            out.append((spec, ids))
        if len(out) == count:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", choices=sorted(VOCABS), default="131k")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.k < 1 or args.reps < 1:
        ap.error("--batch, --k and --reps must be at least 1")
    import torch

    from vllm_patch.testing.vocabularies import json_grammar, load_tokenizer, make_backend

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(VOCABS[args.vocab])
    backend = make_backend("xgrammar", tokenizer)
    docs = documents(backend, tokenizer, 64, args.k + 8)
    if not docs:
        raise SystemExit("no MaskBench document compiles and validates")
    rng = random.Random(args.seed)
    reqs = []
    for _ in range(args.batch):
        spec, ids = docs[rng.randrange(len(docs))]
        g = json_grammar(backend, spec)
        start = rng.randrange(0, len(ids) - args.k)
        assert g.accept_tokens("r", ids[:start])
        reqs.append((g.matcher, ids[start:start + args.k]))
    k, per = args.k, args.k + 1
    words = (backend.vocab_size + 31) // 32
    big = torch.full((args.batch * per, words), -1, dtype=torch.int32)
    small = torch.full((per, words), -1, dtype=torch.int32)

    def in_batch() -> int:
        t0 = time.thread_time_ns()
        for r, (m, drafts) in enumerate(reqs):
            for j in range(per):
                m.fill_next_token_bitmask(big, r * per + j)
                if j < k:
                    m.accept_token(drafts[j])
            m.rollback(k)
        return time.thread_time_ns() - t0

    def buffered() -> int:
        t0 = time.thread_time_ns()
        for r, (m, drafts) in enumerate(reqs):
            for j in range(per):
                m.fill_next_token_bitmask(small, j)
                if j < k:
                    m.accept_token(drafts[j])
            m.rollback(k)
            big[r * per:(r + 1) * per].copy_(small)
        return time.thread_time_ns() - t0

    reference = None
    times: dict[str, list[int]] = {"batch": [], "buffer": []}
    for _ in range(args.reps):
        times["batch"].append(in_batch())
        if reference is None:
            reference = big.clone()
        big.fill_(-1)
        times["buffer"].append(buffered())
        if not torch.equal(big, reference):
            print("the two ways wrote different rows", file=sys.stderr)
            return 1
    rows = args.batch * per
    us = {mode: statistics.median(v) / rows / 1e3 for mode, v in times.items()}
    print(f"{args.vocab} xgrammar, B={args.batch}, k={k}, {rows} rows, median of "
          f"{args.reps}: batch bitmask {us['batch']:.1f} us a row, small buffer + copy "
          f"{us['buffer']:.1f} us a row ({us['buffer'] / us['batch']:.2f}x); rows identical")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": vars(args), "rows": rows, "us_per_row": us}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
