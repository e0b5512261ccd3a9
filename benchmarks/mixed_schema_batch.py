"""One mixed batch of real JSON schemas with speculative decoding: counts how
many requests finish `error` (a grammar-rejected token), `stop`, `length`.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/mixed_schema_batch.py
    VLLM_PATCH_DISABLE=1 ... (stock)
    VLLM_PATCH_SKIP=cpu-spec-expand-fix ... (patched without the CPU fix)

58 schemas from ../shared/data/jsonschemabench-dev/schemas (sorted; those the
backend compiles), the tiny local target as its own draft model (k=3), even
requests greedy, odd ones seeded temperature 0.8. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

from vllm_patch.testing import jsonschemabench

SCHEMAS = jsonschemabench.SCHEMAS


def schemas(n: int, backend: str) -> list[tuple[str, dict]]:
    import xgrammar
    from vllm.v1.structured_output.backend_xgrammar import (
        has_xgrammar_unsupported_json_features,
    )

    out = []
    for p in sorted(SCHEMAS.rglob("*.json")):
        try:
            s = json.loads(p.read_text())
            if backend == "xgrammar":
                if has_xgrammar_unsupported_json_features(s):
                    continue
                xgrammar.Grammar.from_json_schema(json.dumps(s))
        except Exception:  # noqa: BLE001 - the backend rejects it: not used
            continue
        out.append((p.name, s))
        if len(out) == n:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=58)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--backend", default="xgrammar")
    ap.add_argument("--max-tokens", type=int, default=192)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_patch.testing.engine import start_llm, stop_llm
    from vllm_patch.testing.tiny_model import build_target

    target = str(build_target())
    items = schemas(a.n, a.backend)
    llm = start_llm(
        structured_outputs_config={"backend": a.backend,
                                   "disable_any_whitespace": True},
        speculative_config={"method": "draft_model", "model": target,
                            "num_speculative_tokens": a.k},
        max_num_seqs=64)
    params = []
    for i, (_, s) in enumerate(items):
        so = StructuredOutputsParams(json=s)
        if i % 2:
            params.append(SamplingParams(temperature=0.8, seed=1000 + i,
                                         max_tokens=a.max_tokens,
                                         structured_outputs=so))
        else:
            params.append(SamplingParams(temperature=0.0,
                                         max_tokens=a.max_tokens,
                                         structured_outputs=so))
    t0 = time.time()
    outs = llm.generate(["Output JSON: "] * len(items), params, use_tqdm=False)
    finish = collections.Counter(o.outputs[0].finish_reason for o in outs)
    by_kind = collections.Counter(
        ("greedy" if i % 2 == 0 else "t0.8", o.outputs[0].finish_reason)
        for i, o in enumerate(outs))
    stop_llm(llm)
    print(json.dumps({
        "mode": "stock" if os.environ.get("VLLM_PATCH_DISABLE") == "1" else
                "patched", "skip": os.environ.get("VLLM_PATCH_SKIP", ""),
        "backend": a.backend, "k": a.k, "n": len(items),
        "finish": dict(finish),
        "by_kind": {f"{k}/{r}": v for (k, r), v in sorted(by_kind.items())},
        "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
