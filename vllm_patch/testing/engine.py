"""Client-side helpers for a real vLLM engine on the tiny local model.

`start_llm()` builds an `LLM` with settings that work on a CPU-only box (see
../shared/research/vllm-cpu-end-to-end.md); `engine_core_probe()` asks the
live engine core what the plugin did there (`EngineCore.vllm_patch_probe`,
added by vllm_patch.v1.engine.core); `worker_probe()` asks the workers;
`spec_decode_counts()` reads the spec-decode counters from `llm.get_metrics()`.

Environment variables (VLLM_PATCH_*, VLLM_ENABLE_V1_MULTIPROCESSING) must be
set before `start_llm()`: the engine-core and worker processes inherit them.
Scripts that start a multiprocess engine need an `if __name__ == "__main__":`
guard (spawn).
"""

from __future__ import annotations

import gc
import os
from typing import Any

from vllm_patch.v1.engine.core import PROBE_METHOD, probe_report

STRUCTURED_OUTPUTS_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}


class ProbeUnavailable(RuntimeError):
    """The engine core has no probe method: the plugin patched nothing there."""


def in_process() -> bool:
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"


def engine_kwargs(model: str | os.PathLike | None = None, **overrides: Any) -> dict:
    from vllm_patch.testing.tiny_model import build_target

    kwargs: dict[str, Any] = dict(
        model=str(model or build_target()),
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        seed=0,
        kv_cache_memory_bytes=256 * 2**20,
        disable_log_stats=False,  # get_metrics() needs the stat loggers
        structured_outputs_config=dict(STRUCTURED_OUTPUTS_CONFIG),
    )
    kwargs.update(overrides)
    return kwargs


def start_llm(model: str | os.PathLike | None = None, **overrides: Any):
    """A real LLM on the tiny target (or `model`); no network."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm import LLM

    return LLM(**engine_kwargs(model, **overrides))


def stop_llm(llm: Any) -> None:
    """Shut the engine core (and its processes) down now, not at GC time."""
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        del llm
        gc.collect()


def engine_core_probe(llm: Any) -> dict[str, Any]:
    """The probe report from inside the engine-core process.

    In-process engines without the probe patch (VLLM_PATCH_DISABLE=1) are
    probed by calling `probe_report` directly on the EngineCore object; a
    multiprocess engine without it raises ProbeUnavailable."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)  # InprocClient
    if core is not None and not isinstance(core, (str, bytes)) and hasattr(core, "scheduler"):
        method = getattr(core, PROBE_METHOD, None)
        report = method() if method is not None else probe_report(core)
        report["via"] = "in-process" + ("" if method is not None else " (direct)")
        return report
    try:
        report = client.call_utility(PROBE_METHOD)
    except Exception as exc:  # vLLM wraps the engine-side AttributeError
        raise ProbeUnavailable(f"engine core has no {PROBE_METHOD}: {exc}") from exc
    report["via"] = "utility call"
    return report


def _worker_report(worker: Any) -> dict[str, Any]:
    from vllm_patch import envs, patching

    runner = getattr(worker, "model_runner", None)
    return {
        "pid": os.getpid(),
        "disabled": envs.settings().disable,
        "outcomes": {n: o.state.value for n, o in patching.REGISTRY.outcomes.items()},
        "use_async_scheduling": bool(getattr(runner, "use_async_scheduling", False)),
    }


def worker_probe(llm: Any) -> list[dict[str, Any]]:
    """One report per worker (collective_rpc runs the function in each)."""
    return llm.collective_rpc(_worker_report)


def spec_decode_counts(llm: Any) -> dict[str, Any]:
    """Cumulative spec-decode counters of this process's metrics registry;
    subtract two snapshots to measure one phase."""
    counts: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0,
                              "per_pos": []}
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    for metric in llm.get_metrics():
        if metric.name in names:
            counts[names[metric.name]] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = list(metric.values)
            per = counts["per_pos"]
            per.extend([0] * (len(values) - len(per)))
            for i, v in enumerate(values):
                per[i] += int(v)
    return counts


def counts_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    per = [a - (before["per_pos"][i] if i < len(before["per_pos"]) else 0)
           for i, a in enumerate(after["per_pos"])]
    out = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    out["per_pos"] = per
    out["acceptance"] = out["accepted"] / out["draft_tokens"] if out["draft_tokens"] else 0.0
    return out


PROMPTS = [
    '{"name":"alice","age":',
    "yes no true false red green",
    '{"name":"bob","ok":true,"city":"',
    "abc-def_ghi.",
]

JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


def _terminals() -> set[int]:
    from vllm_patch.testing import tiny_model

    return {tiny_model.EOS, tiny_model.IM_END}


TERMINALS = _terminals()


def post_grammar(ids) -> int:
    """Tokens after the first grammar terminal (EOS / <|im_end|>)."""
    for i, t in enumerate(ids):
        if t in TERMINALS:
            return len(ids) - i - 1
    return 0


def tally(counts: Any, ok: bool, text: str, ids, finish: str | None) -> list[str]:
    """Count one structured output (valid, post_grammar_tokens, requests,
    finish_<reason>) and say what is wrong with it, for the end-to-end tests
    and the demo."""
    post = post_grammar(ids)
    counts["requests"] += 1
    counts["valid"] += ok
    counts["post_grammar_tokens"] += post
    counts[f"finish_{finish}"] += 1
    bad = []
    if not ok:
        bad.append(f"invalid {text[:50]!r}")
    if post:
        bad.append(f"{post} token(s) after the grammar's end")
    if finish != "stop":
        bad.append(f"finish_reason {finish}")
    return bad


def tally_completion(counts: Any, ok: bool, c: Any) -> list[str]:
    """tally() for an LLM CompletionOutput, plus: it ends on the grammar's
    terminal and has one logprob row per token."""
    bad = tally(counts, ok, c.text, c.token_ids, c.finish_reason)
    if not c.token_ids or c.token_ids[-1] not in TERMINALS:
        bad.append("last token is not the grammar's terminal")
    if c.logprobs is None or len(c.logprobs) != len(c.token_ids):
        bad.append(f"logprob rows {len(c.logprobs or [])} != tokens {len(c.token_ids)}")
    return bad


def tokens_per_step(outs: Any, spec_counts: dict[str, Any]) -> float:
    """Output tokens per target step of `LLM.generate` outputs, with the
    spec-decode counters of that phase (`counts_delta`): steps = steps with
    drafts (the engine's draft count) + the tokens not made by those steps
    (each yields its accepted drafts plus one token). `outs` may also be
    the outputs' token id lists."""
    tokens = sum(len(o) if isinstance(o, list) else len(o.outputs[0].token_ids)
                 for o in outs)
    drafts = spec_counts["drafts"]
    steps = drafts + max(0, tokens - spec_counts["accepted"] - drafts)
    return tokens / max(1, steps)


def benchmark_schemas(backend: str, count: int) -> list[dict]:
    """The first `count` JSONSchemaBench schemas of the shared sample
    (Github_easy, sorted file names) that `backend` takes with compact
    JSON; [] when the sample is missing (`vllm_patch.testing.jsonschemabench`
    says where it is looked for)."""
    import glob
    import json

    from vllm_patch.testing.jsonschemabench import SCHEMAS

    root = str(SCHEMAS / "Github_easy")
    out: list[dict] = []
    for f in sorted(glob.glob(os.path.join(root, "*.json"))):
        with open(f) as fh:
            schema = json.load(fh)
        if backend == "xgrammar":
            from vllm.v1.structured_output.backend_xgrammar import (
                has_xgrammar_unsupported_json_features)

            if has_xgrammar_unsupported_json_features(schema):
                continue
        try:
            _validate_schema(backend, schema)
        except Exception:  # noqa: BLE001 - the backend rejects this schema
            continue
        out.append(schema)
        if len(out) == count:
            break
    return out


def _validate_schema(backend: str, schema: dict) -> None:
    import json

    if backend == "xgrammar":
        import xgrammar as xgr

        xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    else:
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False})
        err = llguidance.LLMatcher.validate_grammar(grammar)
        if err:
            raise ValueError(err)


def check_xgrammar_batching(stats: dict[str, Any], backend: str) -> None:
    """Grammar-aware drafting's counters after an engine run: with xgrammar
    the shadows' accepts went through the batched calls (several rows per
    call) and every batch result was read in one call; other backends never
    take that path."""
    if backend == "xgrammar":
        assert stats["xgr_batch_accept_calls"] > 0, stats
        assert stats["xgr_batch_accept_rows"] > stats["xgr_batch_accept_calls"], stats
        assert stats["xgr_flags_slow"] == 0, stats
    else:
        assert stats["xgr_batch_accept_calls"] == 0, stats
