"""How many output tokens forced drafts can supply, counted offline on real
JSON outputs with real tokenizers.

Each valid MaskBench instance (JSONSchemaBench's mask benchmark data,
`../shared/data/jsonschemabench-dev/maskbench/`) is tokenized as a model
writes it and walked token by token through its schema's grammar, compiled
by vLLM's own structured-output backend (xgrammar, guidance) for vLLM's
tokenizer classes. At each committed position the grammar's forced
continuation is turned into tokens by
`vllm_patch.v1.spec_decode.forced_drafts.forced_tokens`, and compared with
the instance's next tokens: the forced drafts a perfect model would accept.

Figures per tokenizer, backend, whitespace rule and instance format:
- forced share: tokens supplied by accepted forced drafts when decoding
  jumps over them (one model token, then the accepted forced drafts, then
  the next model token...), the way MaskBench counts fast-forward tokens;
  unbounded and with at most k drafts per step;
- forced drafts accepted: of the forced drafts proposed on that walk, the
  share equal to the instance's tokens (a perfect model's acceptance);
- single-allowed share: positions where the grammar allows exactly one
  token (the rule forced drafts used before);
- in forced text: tokens that lie inside the grammar's forced text (an
  upper bound no tokenization rule can beat);
- llguidance's own `compute_ff_tokens` share (guidance only, reference);
- cost of one forced_tokens call (thread CPU time, us): mean, p50, p99,
  for the calls with nothing forced and with forced text.

Vocabularies: mistral_common's Tekken (131,072 tokens) and SentencePiece
v3 (32,768; guidance does not take it), through vLLM's MistralTokenizer,
and the tiny world's 8,192-token BPE when it is built
(`python -m vllm_patch.testing.tiny_world`).

    python benchmarks/forced_share.py                       # all, ~20 min
    python benchmarks/forced_share.py --tokenizers tekken --limit 100
    python benchmarks/forced_share.py --json /tmp/forced_share.json

Formats: "compact" is `json.dumps(x, separators=(",", ":"))`; "spaced" is
`json.dumps(x)` (", " and ": ", the default of most serializers). Grammars:
"flexible" whitespace is vLLM's default; "none" is
`disable_any_whitespace=True` (compact only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from vllm_patch.testing.vocabularies import (json_grammar, load_tokenizer,
                                             make_backend, vocab_size)
from vllm_patch.v1.spec_decode.grammar_drafts import _common

REPO = Path(__file__).resolve().parents[1]
MASKBENCH = REPO.parent / "shared" / "data" / "jsonschemabench-dev" / "maskbench"
if not MASKBENCH.is_dir():
    MASKBENCH = Path("/work/shared/data/jsonschemabench-dev/maskbench")

CONFIGS = (  # (format, whitespace)
    ("compact", "none"),
    ("compact", "flexible"),
    ("spaced", "flexible"),
)
UNBOUNDED = 64


def instances(limit: int | None) -> list[tuple[str, Any, list[Any]]]:
    out = []
    for path in sorted(MASKBENCH.glob("*.json")):
        entry = json.loads(path.read_text())
        valid = [t["data"] for t in entry.get("tests", []) if t.get("valid")]
        if valid:
            out.append((path.stem, entry["schema"], valid))
        if limit is not None and len(out) >= limit:
            break
    return out


def render(data: Any, fmt: str) -> str:
    if fmt == "compact":
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return json.dumps(data, ensure_ascii=False)


def _single_allowed(mask: Any) -> bool:
    words = mask.numpy().view(np.uint32).ravel()
    nz = np.flatnonzero(words)
    if len(nz) != 1:
        return False
    w = int(words[nz[0]])
    return w & (w - 1) == 0


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(tokenizer: Any, kind: str, whitespace: str, fmt: str,
        items: list[tuple[str, Any, list[Any]]], k: int) -> dict[str, Any]:
    from vllm_patch.v1.spec_decode.forced_drafts import (
        Outcome, forced_bytes, forced_tokens, vocab_for)

    backend = make_backend(kind, tokenizer, whitespace)
    mask = backend.allocate_token_bitmask(1)
    eos = tokenizer.eos_token_id
    c = dict(schemas=0, compile_errors=0, instances=0, rejected=0, tokens=0,
             single=0, in_text=0, jf_unbounded=0, jf_k=0,
             proposed_unbounded=0, accepted_unbounded=0, proposed_k=0,
             accepted_k=0, ll_ff=0, ll_proposed=0, ll_accepted=0)
    results: dict[str, int] = {}
    cost_none: list[float] = []
    cost_forced: list[float] = []
    compile_s = 0.0
    for _, schema, datas in items:
        t0 = time.perf_counter()
        try:
            grammar = json_grammar(backend, schema)
        except Exception:  # noqa: BLE001 - schemas a backend refuses
            c["compile_errors"] += 1
            continue
        compile_s += time.perf_counter() - t0
        c["schemas"] += 1
        vocab = vocab_for(grammar, tokenizer)
        for data in datas:
            grammar.reset()
            if hasattr(grammar, "terminated"):
                grammar.terminated = False
            ids = vocab.encode_after(render(data, fmt))
            if ids is None or len(grammar.validate_tokens(ids + [eos])) \
                    != len(ids) + 1:
                c["rejected"] += 1
                continue
            c["instances"] += 1
            c["tokens"] += len(ids)
            ff_at: list[list[int]] = []
            ll_at: list[list[int]] = []
            for i, tok in enumerate(ids):
                grammar.fill_bitmask(mask, 0)
                c["single"] += _single_allowed(mask)
                text = forced_bytes(grammar)
                tb = vocab.token_bytes[tok]
                c["in_text"] += bool(text) and text.startswith(tb)
                oc = Outcome()
                t1 = time.thread_time_ns()
                ff = forced_tokens(grammar, ids[:i], tokenizer, UNBOUNDED,
                                   outcome=oc)
                dt = (time.thread_time_ns() - t1) / 1000
                (cost_forced if oc.forced else cost_none).append(dt)
                results[oc.result] = results.get(oc.result, 0) + 1
                ff_at.append(ff)
                if kind == "guidance":
                    ll_at.append(list(grammar.ll_matcher.compute_ff_tokens()))
                assert grammar.accept_tokens("bench", [tok])
            for cap, key in ((UNBOUNDED, "unbounded"), (k, "k")):
                i = 0
                while i < len(ids):
                    ff = ff_at[i][:cap]
                    n = _common(ff, ids[i:])
                    c[f"proposed_{key}"] += len(ff)
                    c[f"accepted_{key}"] += n
                    c[f"jf_{key}"] += n
                    i += n + 1
            if ll_at:
                i = 0
                while i < len(ids):
                    n = _common(ll_at[i], ids[i:])
                    c["ll_proposed"] += len(ll_at[i])
                    c["ll_accepted"] += n
                    c["ll_ff"] += n
                    i += n + 1
    tokens = max(c["tokens"], 1)
    allc = cost_none + cost_forced
    out: dict[str, Any] = dict(c)
    out.update(
        forced_share=c["jf_unbounded"] / tokens,
        forced_share_k=c["jf_k"] / tokens,
        forced_accept=c["accepted_unbounded"] / max(c["proposed_unbounded"], 1),
        single_share=c["single"] / tokens,
        in_text_share=c["in_text"] / tokens,
        ll_share=(c["ll_ff"] / tokens) if kind == "guidance" else None,
        ll_accept=(c["ll_accepted"] / max(c["ll_proposed"], 1))
        if kind == "guidance" else None,
        outcomes=results,
        calls=len(allc),
        cost_mean_us=statistics.fmean(allc) if allc else 0.0,
        cost_none_mean_us=statistics.fmean(cost_none) if cost_none else 0.0,
        cost_none_p50_us=_pct(cost_none, 0.5),
        cost_none_p99_us=_pct(cost_none, 0.99),
        cost_forced_mean_us=statistics.fmean(cost_forced) if cost_forced else 0.0,
        cost_forced_p50_us=_pct(cost_forced, 0.5),
        cost_forced_p99_us=_pct(cost_forced, 0.99),
        forced_calls_share=len(cost_forced) / max(len(allc), 1),
        compile_s=compile_s,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizers", default="tekken,spm,tiny")
    ap.add_argument("--backends", default="xgrammar,guidance")
    ap.add_argument("--configs", default=",".join(f"{f}/{w}" for f, w in CONFIGS),
                    help="format/whitespace pairs, e.g. compact/none")
    ap.add_argument("--limit", type=int, default=None,
                    help="first N MaskBench files with valid instances")
    ap.add_argument("--k", type=int, default=4, help="draft slots per step")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    items = instances(args.limit)
    rows = []
    for name in args.tokenizers.split(","):
        tokenizer = load_tokenizer(name)
        if tokenizer is None:
            print(f"{name}: not built, skipped", file=sys.stderr)
            continue
        for kind in args.backends.split(","):
            if kind == "guidance" and getattr(tokenizer, "is_spm", False):
                continue  # vLLM's guidance backend refuses SentencePiece
            for pair in args.configs.split(","):
                fmt, ws = pair.split("/")
                t0 = time.perf_counter()
                r = run(tokenizer, kind, ws, fmt, items, args.k)
                r.update(tokenizer=name, vocab=vocab_size(tokenizer),
                         backend=kind, format=fmt, whitespace=ws,
                         seconds=round(time.perf_counter() - t0, 1))
                rows.append(r)
                print(_line(r, args.k), flush=True)
    print()
    print(table(rows, args.k))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


HEADER = ("| vocabulary | backend | text / grammar whitespace | instances | tokens "
          "| forced share (k={k}) | unbounded | accepted | llguidance ff "
          "| single-allowed | in forced text | us/call: mean | none p50 "
          "| forced p50 / p99 |")


def _line(r: dict, k: int) -> str:
    ll = (f" | {100 * r['ll_share']:.1f} %" if r["ll_share"] is not None
          else " | -")
    return (f"| {r['tokenizer']} {r['vocab']:,} | {r['backend']} | "
            f"{r['format']} / {r['whitespace']} | {r['instances']} "
            f"({r['rejected']} rejected) | {r['tokens']:,} "
            f"| {100 * r['forced_share_k']:.1f} % | {100 * r['forced_share']:.1f} % "
            f"| {100 * r['forced_accept']:.1f} %{ll} "
            f"| {100 * r['single_share']:.1f} % | {100 * r['in_text_share']:.1f} % "
            f"| {r['cost_mean_us']:.1f} | {r['cost_none_p50_us']:.1f} "
            f"| {r['cost_forced_p50_us']:.0f} / {r['cost_forced_p99_us']:.0f} |")


def table(rows: list[dict], k: int) -> str:
    head = HEADER.format(k=k)
    sep = "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"
    return "\n".join([head, sep] + [_line(r, k) for r in rows])


if __name__ == "__main__":
    sys.exit(main())
