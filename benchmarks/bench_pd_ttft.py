"""Gap F benchmark: decode-side time to first token of a P/D request whose
grammar compiles while its KV is pulled, patched vs stock.

Scheduler tier (vllm_patch.testing.pd_sched): the real vLLM Scheduler with the real
NixlConnector (scheduler role), a real xgrammar compile in vLLM's compile
pool for a JSON schema that takes >= 20 ms on the tiny tokenizer (unique per
trial, so xgrammar's cache never answers), and a KV transfer simulated as a
fixed wall-clock delay from the step whose connector metadata requested the
load to the step that reports `finished_recving`. The engine loop is
emulated: schedule -> (model step of `--step-ms`) -> update_from_output.
TTFT = add_request -> the step that schedules the request's first decode
token (the recomputed last prompt token), i.e. the decode side's share.

Stock: compile, then request the KV (compile + transfer). Patched: both at
once (max(compile, transfer)). Stock runs after `patching.revert_all()` in
the same process.

    python benchmarks/bench_pd_ttft.py --trials 5
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=/root/.cache/vllm-patch/vllm-0.33.0 \
        python benchmarks/bench_pd_ttft.py --trials 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def schema(n_fields: int, salt: int) -> dict:
    props = {}
    for i in range(n_fields):
        if i % 3 == 0:
            props[f"f{salt}_{i}"] = {"type": "string", "pattern": "^[a-z]{1,%d}$" % (i % 7 + 1)}
        elif i % 3 == 1:
            props[f"f{salt}_{i}"] = {"type": "integer", "minimum": 0, "maximum": i * 37}
        else:
            props[f"f{salt}_{i}"] = {"type": "array", "minItems": 1, "maxItems": 5, "items": {
                "type": "object", "properties": {"a": {"type": "number"},
                                                 "b": {"type": "string", "format": "date-time"}},
                "required": ["a", "b"]}}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def compile_ms(n_fields: int, salt: int) -> float:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from vllm_patch.testing.tiny_model import build_target

    tok = AutoTokenizer.from_pretrained(str(build_target()))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    c = xgr.GrammarCompiler(info, cache_enabled=False)
    t = time.perf_counter()
    c.compile_json_schema(json.dumps(schema(n_fields, salt)), any_whitespace=False)
    return (time.perf_counter() - t) * 1e3


def one_trial(n_fields: int, salt: int, transfer_ms: float, step_ms: float) -> float:
    from vllm_patch.testing.pd_sched import PDDecodeSched

    h = PDDecodeSched()
    t0 = time.perf_counter()
    rid = h.add_remote_request(prompt_len=64, json=schema(n_fields, salt),
                               hold_grammar=False)
    load_started = None
    while True:
        so = h.schedule()
        now = time.perf_counter()
        if h.sched.requests[rid].status.name == "WAITING_FOR_REMOTE_KVS" and load_started is None:
            load_started = now
        if so.num_scheduled_tokens.get(rid):
            return (now - t0) * 1e3
        done = load_started is not None and (now - load_started) * 1e3 >= transfer_ms
        if step_ms:
            time.sleep(step_ms / 1e3)
        else:
            time.sleep(0.0005)
        mro = h.model_output(so, finished_recving={rid} if done else None)
        h.sched.update_from_output(so, mro)
        if done:
            load_started = float("inf")  # reported once


def run(trials: int, fields: list[int], transfers: list[float], step_ms: float,
        label: str, salt0: int) -> dict:
    res = {}
    salt = salt0
    for nf in fields:
        for tr in transfers:
            xs = []
            for _ in range(trials):
                salt += 1
                xs.append(one_trial(nf, salt, tr, step_ms))
            res[(nf, tr)] = statistics.median(xs)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--fields", default="96,160")
    ap.add_argument("--transfers-ms", default="25,50,100")
    ap.add_argument("--step-ms", type=float, default=0.0)
    a = ap.parse_args()
    fields = [int(x) for x in a.fields.split(",")]
    transfers = [float(x) for x in a.transfers_ms.split(",")]

    import vllm_patch
    from vllm_patch import patching

    vllm_patch.register()
    cms = {nf: statistics.median(compile_ms(nf, 10_000 + nf * 10 + i) for i in range(3))
           for nf in fields}
    one_trial(fields[0], 1, 1.0, 0.0)  # warm-up (imports, first compile)
    patched = run(a.trials, fields, transfers, a.step_ms, "patched", 100_000)
    patching.revert_all()
    stock = run(a.trials, fields, transfers, a.step_ms, "stock", 200_000)
    vllm_patch.register()

    print(f"vLLM {patching.vllm_version()}  trials {a.trials} (median), step {a.step_ms} ms")
    print("fields  compile_ms  transfer_ms  stock_ttft_ms  patched_ttft_ms  ratio")
    for (nf, tr), p in patched.items():
        s = stock[(nf, tr)]
        print(f"{nf:6d}  {cms[nf]:10.1f}  {tr:11.0f}  {s:13.1f}  {p:15.1f}  {p / s:5.2f}")


if __name__ == "__main__":
    main()
