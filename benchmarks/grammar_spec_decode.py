"""Grammar-aware speculative decoding, measured: stock spec decoding, patched
without and patched with grammar-aware drafting, in one run, on the tiny world
(vllm_patch.testing.tiny_world: 8k BPE tokenizer, a target trained on
JSONSchemaBench instances, a smaller draft model and an EAGLE head).

    python benchmarks/grammar_spec_decode.py            # full run (tens of minutes)
    python benchmarks/grammar_spec_decode.py --quick    # about 2 minutes
    python -m vllm_patch.testing.tiny_world            # build the world first (~15 min)

Each (drafter, mode) runs in its own subprocess (in-process engine, bounded by
--timeout): modes stock (VLLM_PATCH_DISABLE=1), without (VLLM_PATCH_FORCED_DRAFTS=0
VLLM_PATCH_MASKED_DRAFTS=0) and with (the defaults); drafters draft (the small
draft model), eagle (the EAGLE-1 head) and perfect (draft_model = the target,
greedy), k drafts; plus non-speculative constrained decoding for the greedy
identity check. Workload: a seeded sample of the schemas in
../shared/data/jsonschemabench-dev/schemas (those xgrammar compiles), greedy and
temperature 0.7 (seeded), and unstructured text requests.

Per request the engine is stepped with delta outputs, so a target forward pass
is counted exactly (one per step in which the request produced tokens);
acceptance comes from vLLM's spec-decoding counters
(vllm_patch.testing.engine.spec_decode_counts).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "stock": {"VLLM_PATCH_DISABLE": "1"},
    "without": {"VLLM_PATCH_FORCED_DRAFTS": "0", "VLLM_PATCH_MASKED_DRAFTS": "0"},
    "with": {},
}
DRAFTERS = ("draft", "eagle", "perfect")
RESULT = "RESULT "
# The world's tokenizer adds no BOS; the target was trained with one first.
BOS_TEXT = "<s>"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="grammar_spec_decode.py",
        description="Stock vs patched speculative decoding with structured outputs "
                    "on the tiny world (needs `python -m vllm_patch.testing.tiny_world` first).")
    ap.add_argument("--schemas", type=int, default=40,
                    help="schemas sampled from the JSONSchemaBench sample (default 40)")
    ap.add_argument("--texts", type=int, default=12,
                    help="unstructured text requests per phase (default 12)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step (default 4)")
    ap.add_argument("--drafters", default=",".join(DRAFTERS),
                    help=f"comma-separated subset of {','.join(DRAFTERS)}")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--max-tokens", type=int, default=256,
                    help="max tokens per structured request (default 256)")
    ap.add_argument("--text-tokens", type=int, default=96,
                    help="max tokens per unstructured request (default 96)")
    ap.add_argument("--timeout", type=float, default=900,
                    help="seconds per engine subprocess (default 900)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: perfect drafter, 3 schemas, 2 texts, short outputs")
    ap.add_argument("--jobs", type=int, default=1,
                    help="engine subprocesses at once (default 1); with 3, the three modes "
                         "of a drafter run side by side under the same machine load")
    ap.add_argument("--json", metavar="PATH", help="also write all results as JSON here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.quick:
        a.schemas, a.texts, a.max_tokens, a.text_tokens = 3, 2, 64, 32
        a.drafters = "perfect"
    for name, allowed in (("drafters", DRAFTERS), ("modes", tuple(MODES))):
        items = [x.strip() for x in getattr(a, name).split(",") if x.strip()]
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            ap.error(f"--{name}: unknown {bad or 'empty list'}; choose from {','.join(allowed)}")
        setattr(a, name, items)
    for name in ("schemas", "texts", "k", "max_tokens", "text_tokens", "jobs"):
        if getattr(a, name) < (0 if name == "texts" else 1):
            ap.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if a.timeout <= 0:
        ap.error("--timeout must be positive")
    return a


# ------------------------------------------------------------------ worker

def workload(a: argparse.Namespace, tokenizer_dir: Path) -> list[dict]:
    """The requests of one run, identical in every subprocess."""
    import xgrammar

    from vllm.v1.structured_output.backend_xgrammar import (
        has_xgrammar_unsupported_json_features,
    )
    from vllm_patch.testing import tiny_world as w

    items = []
    for p in sorted(w.SCHEMAS.rglob("*.json")):
        try:
            s = json.loads(p.read_text())
            if has_xgrammar_unsupported_json_features(s):
                continue
            xgrammar.Grammar.from_json_schema(json.dumps(s), any_whitespace=False)
        except Exception:  # noqa: BLE001 - xgrammar rejects it: not in the workload
            continue
        items.append((f"{p.parent.name}/{p.stem}", s))
    rng = random.Random(a.seed)
    rng.shuffle(items)
    items = items[: a.schemas]
    reqs = []
    for name, s in items:
        prompt = BOS_TEXT + w.prompt_for_schema(s)
        reqs.append({"id": f"greedy:{name}", "kind": "structured", "prompt": prompt,
                     "schema": s, "temperature": 0.0})
        reqs.append({"id": f"t0.7:{name}", "kind": "structured", "prompt": prompt,
                     "schema": s, "temperature": 0.7})
    paras = w.english_text(w.WORLD_CONFIG["text_chars"])
    for i in rng.sample(range(len(paras)), a.texts):
        head = " ".join(paras[i].split()[:10])
        for temp in (0.0, 0.7):
            reqs.append({"id": f"{'greedy' if temp == 0 else 't0.7'}:text{i}",
                         "kind": "unstructured", "prompt": BOS_TEXT + w.prompt_for_text(head),
                         "schema": None, "temperature": temp})
    return reqs


def run_worker(spec: dict) -> dict:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import jsonschema
    import torch
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    from vllm_patch.testing import engine, tiny_world as w

    torch.set_num_threads(1)
    a = argparse.Namespace(**spec["args"])
    world = w.cached_world(need=())
    drafter = spec["drafter"]
    speculative = None
    if drafter != "none":
        model = world[{"draft": "draft", "eagle": "eagle", "perfect": "target"}[drafter]]
        speculative = {"method": "eagle" if drafter == "eagle" else "draft_model",
                       "model": str(model), "num_speculative_tokens": a.k}
    t0 = time.time()
    llm = engine.start_llm(world["target"], speculative_config=speculative,
                           max_model_len=2048, max_num_seqs=32,
                           kv_cache_memory_bytes=512 * 2**20)
    start_s = time.time() - t0
    reqs = workload(a, world["tokenizer"])
    eng = llm.llm_engine
    tok = llm.get_tokenizer()
    log = lambda m: print(f"  [{drafter}/{spec['mode']}] {m}", file=sys.stderr, flush=True)  # noqa: E731

    def params(r: dict, seed: int) -> SamplingParams:
        so = StructuredOutputsParams(json=r["schema"]) if r["schema"] is not None else None
        limit = a.max_tokens if r["kind"] == "structured" else a.text_tokens
        return SamplingParams(temperature=r["temperature"], seed=seed if r["temperature"] else None,
                              max_tokens=limit, structured_outputs=so,
                              output_kind=RequestOutputKind.DELTA)

    def phase(batch: list[tuple[int, dict]]) -> dict:
        before = engine.spec_decode_counts(llm)
        tokens: dict[str, list[int]] = {r["id"]: [] for _, r in batch}
        passes = {r["id"]: 0 for _, r in batch}
        finish: dict[str, str] = {}
        for i, r in batch:
            eng.add_request(r["id"], r["prompt"], params(r, a.seed + i))
        t = time.time()
        while eng.has_unfinished_requests():
            for out in eng.step():
                c = out.outputs[0]
                if c.token_ids:
                    passes[out.request_id] += 1
                    tokens[out.request_id] += list(c.token_ids)
                if out.finished:
                    finish[out.request_id] = c.finish_reason
        wall = time.time() - t
        counts = engine.counts_delta(engine.spec_decode_counts(llm), before)
        return {"wall": wall, "tokens": tokens, "passes": passes, "finish": finish,
                "counts": counts}

    # warm-up (compiles, first-call costs) outside the measurement
    warm = [(0, dict(reqs[0], id="warmup-s")), (1, dict(reqs[-1], id="warmup-u"))]
    phase(warm)
    res: dict = {"drafter": drafter, "mode": spec["mode"], "engine_start_s": round(start_s, 1),
                 "phases": {}, "outputs": {}}
    for kind in ("structured", "unstructured"):
        for temp in (0.0, 0.7):
            batch = [(i, r) for i, r in enumerate(reqs)
                     if r["kind"] == kind and r["temperature"] == temp]
            if not batch:
                continue
            p = phase(batch)
            valid = 0
            for i, r in batch:
                ids = p["tokens"][r["id"]]
                res["outputs"][r["id"]] = ids
                if r["schema"] is not None:
                    try:
                        jsonschema.validate(json.loads(tok.decode(ids, skip_special_tokens=True)),
                                            r["schema"])
                        valid += 1
                    except Exception:  # noqa: BLE001 - invalid output or unusable schema
                        pass
            name = f"{kind}/{'greedy' if temp == 0 else 't0.7'}"
            n_tok = sum(len(v) for v in p["tokens"].values())
            res["phases"][name] = {
                "requests": len(batch), "tokens": n_tok, "passes": sum(p["passes"].values()),
                "wall": round(p["wall"], 3), "valid": valid, "counts": p["counts"],
                "finish": sorted(set(p["finish"].values()))}
            log(f"{name}: {len(batch)} requests, {n_tok} tokens, "
                f"{sum(p['passes'].values())} target passes, {p['wall']:.1f} s, "
                f"acceptance {p['counts']['acceptance']:.2f}")
    if drafter == "none":  # the same schema prompts without the grammar: does the
        # model follow JSON on its own, as a real model mostly does?
        batch = [(i, dict(r, id="free:" + r["id"], schema=None)) for i, r in enumerate(reqs)
                 if r["kind"] == "structured" and r["temperature"] == 0.0]
        p = phase(batch)
        parsed = follows = 0
        for i, r in batch:
            text = tok.decode(p["tokens"][r["id"]], skip_special_tokens=True)
            try:
                obj = json.loads(text)
            except ValueError:
                continue
            parsed += 1
            try:
                jsonschema.validate(obj, reqs[i]["schema"])
                follows += 1
            except Exception:  # noqa: BLE001 - does not follow it, or unusable schema
                pass
        res["unconstrained"] = {"requests": len(batch), "valid_json": parsed,
                                "follows_schema": follows}
        log(f"unconstrained on the schema prompts: {parsed}/{len(batch)} valid JSON, "
            f"{follows} follow the schema")
    engine.stop_llm(llm)
    if drafter == "none":  # the grammar-forced share of the model's own outputs
        forced = span = total = 0
        for r in reqs:
            if r["schema"] is None or r["id"] not in res["outputs"]:
                continue
            f = w.forced_share(world["tokenizer"], r["schema"], res["outputs"][r["id"]])
            if f is not None:
                forced, span, total = forced + f[0], span + f[1], total + f[2]
        res["forced_share"] = {"forced": forced, "span": span, "tokens": total}
    return res


# ------------------------------------------------------------------ parent

def run_child(args: argparse.Namespace, drafter: str, mode: str) -> dict | None:
    env = dict(os.environ)
    for k in ("VLLM_PATCH_DISABLE", "VLLM_PATCH_FORCED_DRAFTS", "VLLM_PATCH_MASKED_DRAFTS"):
        env.pop(k, None)
    env.update(MODES[mode])
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_TARGET_DEVICE="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    spec = {"drafter": drafter, "mode": mode,
            "args": {k: v for k, v in vars(args).items() if k != "worker"}}
    print(f"[{time.strftime('%H:%M:%S')}] {drafter} / {mode} ...", flush=True)
    t = time.time()
    try:
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"  TIMEOUT after {args.timeout:.0f} s: {drafter} / {mode}", flush=True)
        return None
    for line in proc.stderr.splitlines():
        if line.startswith("  ["):
            print(line, flush=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
    if proc.returncode or not lines:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        print(f"  FAILED (exit {proc.returncode}): {drafter} / {mode}\n{tail}", flush=True)
        return None
    print(f"  done in {time.time() - t:.0f} s", flush=True)
    return json.loads(lines[-1][len(RESULT):])


def metrics(ph: dict) -> dict:
    c = ph["counts"]
    steps_with_drafts = c["drafts"]
    return {
        "acceptance": c["accepted"] / c["draft_tokens"] if c["draft_tokens"] else None,
        # tokens per target step of requests in decode with drafts (vLLM's
        # mean acceptance length)
        "tokens_per_step": 1 + c["accepted"] / steps_with_drafts if steps_with_drafts else 1.0,
        "passes_per_token": ph["passes"] / ph["tokens"] if ph["tokens"] else None,
        "tok_s": ph["tokens"] / ph["wall"] if ph["wall"] else None,
        "valid": ph["valid"], "requests": ph["requests"],
    }


def fmt(x, nd=2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def report(args: argparse.Namespace, results: dict) -> list[str]:
    lines = []
    # greedy identity: every mode and drafter against non-speculative decoding
    ref = results.get(("none", "stock"))
    mism = 0
    if ref is not None:
        for (d, m), r in sorted(results.items()):
            if (d, m) == ("none", "stock"):
                continue
            for rid, ids in r["outputs"].items():
                if not rid.startswith("greedy:"):
                    continue
                want = ref["outputs"].get(rid)
                if want is not None and want != ids:
                    n = next((i for i, (x, y) in enumerate(zip(want, ids)) if x != y),
                             min(len(want), len(ids)))
                    print(f"MISMATCH {d}/{m} {rid}: differs from non-speculative at token {n} "
                          f"({len(ids)} vs {len(want)} tokens)")
                    mism += 1
        print(f"greedy identity: {mism} mismatching output(s) against non-speculative "
              f"constrained decoding")
    if ref is not None and ref.get("forced_share", {}).get("tokens"):
        fs = ref["forced_share"]
        print(f"grammar-forced tokens in the structured outputs (non-speculative, xgrammar's "
              f"matcher, {fs['tokens']} tokens): the only allowed token "
              f"{fs['forced'] / fs['tokens']:.1%}, inside the forced continuation "
              f"{fs['span'] / fs['tokens']:.1%} (MaskBench: about 13 %, 15 % compact JSON)")
    if ref is not None and ref.get("unconstrained"):
        u = ref["unconstrained"]
        print(f"target without the grammar on the (held-out) schema prompts, greedy: "
              f"{u['valid_json']}/{u['requests']} valid JSON, {u['follows_schema']}/"
              f"{u['requests']} follow the schema")
    if ref is not None:
        for name, ph in ref["phases"].items():
            x = metrics(ph)
            print(f"non-speculative {name}: {fmt(x['tok_s'], 1)} tokens/s, "
                  f"{fmt(x['passes_per_token'], 3)} target passes/token"
                  + (f", valid {x['valid']}/{x['requests']}" if name.startswith("structured")
                     else ""))
    k = args.k
    rows = []
    hdr = ("| drafter | mode | requests | acceptance | tokens/step | target passes/token "
           "| tokens/s | passes vs stock | tokens/s vs stock | valid JSON |")
    lines.append(hdr)
    lines.append("|" + "---|" * 10)
    for d in args.drafters:
        for kind in ("structured", "unstructured"):
            for temp in ("greedy", "t0.7"):
                stock = results.get((d, "stock"), {}).get("phases", {}).get(f"{kind}/{temp}")
                sm = metrics(stock) if stock else None
                for m in args.modes:
                    ph = results.get((d, m), {}).get("phases", {}).get(f"{kind}/{temp}")
                    if not ph:
                        continue
                    x = metrics(ph)
                    rp = (x["passes_per_token"] / sm["passes_per_token"]
                          if sm and sm["passes_per_token"] else None)
                    rt = x["tok_s"] / sm["tok_s"] if sm and sm["tok_s"] else None
                    valid = f"{x['valid']}/{x['requests']}" if kind == "structured" else "-"
                    lines.append(f"| {d} | {m} | {kind} {temp} | {fmt(x['acceptance'])} | "
                                 f"{fmt(x['tokens_per_step'])} | {fmt(x['passes_per_token'], 3)} | "
                                 f"{fmt(x['tok_s'], 1)} | {fmt(rp)} | {fmt(rt)} | {valid} |")
                    rows.append((d, m, kind, temp, x, rp, rt))
    # targets
    lines.append("")
    lines.append("| target | measured | met |")
    lines.append("|---|---|---|")
    get = {(d, m, kind, temp): (x, rp, rt) for d, m, kind, temp, x, rp, rt in rows}
    best = "with" if "with" in args.modes else args.modes[-1]
    for d in args.drafters:
        s = get.get((d, best, "structured", "greedy"))
        u = get.get((d, best, "unstructured", "greedy"))
        if s and u and s[0]["acceptance"] is not None and u[0]["acceptance"] is not None:
            ok = s[0]["acceptance"] >= u[0]["acceptance"]
            lines.append(f"| {d}: structured acceptance >= unstructured ({best}, greedy) | "
                         f"{s[0]['acceptance']:.2f} vs {u[0]['acceptance']:.2f} | "
                         f"{'met' if ok else 'not met'} |")
        for temp in ("greedy", "t0.7"):
            s = get.get((d, best, "structured", temp))
            if s and s[1] is not None:
                lines.append(f"| {d}: target passes/token <= 0.75x stock (structured {temp}) | "
                             f"{s[1]:.2f}x | {'met' if s[1] <= 0.75 else 'not met'} |")
            if s and s[2] is not None:
                lines.append(f"| {d}: wall tokens/s >= 1.2x stock (structured {temp}) | "
                             f"{s[2]:.2f}x | {'met' if s[2] >= 1.2 else 'not met'} |")
        u = [get.get((d, best, "unstructured", t)) for t in ("greedy", "t0.7")]
        u = [x for x in u if x and x[2]]
        if u and all(x[1] is not None for x in u):
            cost = max(x[1] for x in u)
            lines.append(f"| {d}: unstructured cost <= 1.01x stock (target passes per token) | "
                         f"{cost:.2f}x | {'met' if cost <= 1.01 else 'not met'} |")
        if u:
            cost = max(1 / x[2] for x in u)
            lines.append(f"| {d}: unstructured cost <= 1.01x stock (wall time per token) | "
                         f"{cost:.2f}x | {'met' if cost <= 1.01 else 'not met'} |")
    s = get.get(("perfect", best, "structured", "greedy"))
    if s:
        lines.append(f"| perfect drafter: >= 0.75 (k+1) = {0.75 * (k + 1):.2f} tokens/step "
                     f"(structured greedy) | {s[0]['tokens_per_step']:.2f} | "
                     f"{'met' if s[0]['tokens_per_step'] >= 0.75 * (k + 1) else 'not met'} |")
    lines.append("")
    lines.append(f"greedy identity (all modes and drafters vs non-speculative constrained "
                 f"decoding): {mism} mismatch(es)" if ref else "greedy identity: not checked")
    return lines


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        res = run_worker(json.loads(a.worker))
        print(RESULT + json.dumps(res), flush=True)
        return 0
    sys.path.insert(0, str(ROOT))
    from vllm_patch.testing import tiny_world

    need = {"draft": "draft", "eagle": "eagle", "perfect": "target"}
    world = tiny_world.cached_world(tuple(need[d] for d in a.drafters))
    if world is None:
        print("the tiny world is not built: run `python -m vllm_patch.testing.tiny_world` "
              "first (about 15 minutes on one core)", file=sys.stderr)
        return 2
    try:
        import vllm
        version = vllm.__version__
    except Exception:  # noqa: BLE001
        version = "?"
    print(f"vLLM {version}; world {world['target'].name}; k={a.k}; schemas={a.schemas}; "
          f"texts={a.texts}; drafters={','.join(a.drafters)}; modes={','.join(a.modes)}",
          flush=True)
    t0 = time.time()
    results: dict = {}
    jobs = [("none", "stock")] + [(d, m) for d in a.drafters for m in a.modes]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(a.jobs) as pool:
        for (d, m), r in zip(jobs, pool.map(lambda j: run_child(a, *j), jobs)):
            if r is not None:
                results[(d, m)] = r
    lines = report(a, results)
    print("\n".join(lines))
    print(f"\ntotal wall {time.time() - t0:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(
            {f"{d}/{m}": r for (d, m), r in results.items()}, indent=1))
    return 0 if len(results) == len(jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
