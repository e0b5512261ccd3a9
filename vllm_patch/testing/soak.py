"""Production-mix soak: one seeded stream of mixed requests through the real
front door (the official `openai` client, AsyncOpenAI), every answer checked,
stock and patched runs of the same seed compared.

The mix (`make_request(seed, i)`, request i depends only on seed and i):
real JSON schemas from JSONSchemaBench (also those the grammar backend
rejects: they must get a clean 400), `json_object`, regex, choice, an EBNF
grammar and unstructured requests; temperature 0 / 0.7 / 1.0 with and
without seed, top_p, top_k, min_p, penalties, logprobs / top_logprobs,
n > 1, stop strings, stop_token_ids, min_tokens, small and large
max_tokens, ignore_eos, prompts of one token to near max_model_len (token-id
prompts), chat and completions, streaming and not, and clients that hang up
mid-stream. Concurrency varies between 1 and 32 over the stream.

Checks per request (failure kinds): `http_5xx`, `http_error` (no answer),
`stream_error` (an error event inside a streamed answer; vLLM refuses a
streamed request that way, with the 400 in the event, which counts as the
400 it is),
`unexpected_4xx` (a request the backend accepts was refused),
`rejected_not_4xx` (a grammar the backend rejects was served), `finish_<x>`
(neither stop nor length), `invalid_json` / `invalid_output` (finish stop
but the text does not parse and validate against its schema / match its
regex or choice), `schema_looser_than_grammar` (invalid against its schema
although the replay accepts every token and the end: the backend's grammar
admits what the schema refuses), `post_grammar` (tokens after the grammar's end, found by
replaying the output token ids through the request's own backend, xgrammar
or guidance, on the tiny model's tokenizer), `grammar_rejected` (a token
the grammar does not accept), `logprobs_misaligned` (logprob rows !=
tokens, or more top logprobs than asked), `n_mismatch`, `too_many_tokens`.
Per run: `server_restarted` (an instance's process start time changed or it
died), `invariant_violations` (vllm_patch's checker counter on /metrics
above 0), `kv_not_idle` (KV blocks in use / requests running once the
stream drained, on every instance).

    python -m vllm_patch.testing.soak run --mode patched --out /tmp/soak/p \\
        --requests 1000 --backend xgrammar --spec draft_model --sched async
    python -m vllm_patch.testing.soak run --mode stock --out /tmp/soak/s ...
    python -m vllm_patch.testing.soak diff /tmp/soak/s /tmp/soak/p

`--target pd --connector ExampleConnector|NixlConnector` runs the stream
against a P/D pair started by `vllm-patch launch` (the router in front).
The stock run is the same command with VLLM_PATCH_DISABLE=1 in the servers'
environment (`--mode stock`). A rerun with the same `--out` skips request
ids already recorded (resumable). Every process started is stopped by its
process group id.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from vllm_patch.testing import jsonschemabench

SCHEMAS = Path(os.environ.get("VLLM_PATCH_SOAK_SCHEMAS", jsonschemabench.SCHEMAS))
MAX_MODEL_LEN = 512
MODEL = "tiny"
REGEXES = [r"[a-z]{2,6}-[0-9]{1,3}", r"(yes|no)( (red|green|blue)){0,3}",
           r"[0-9]{1,4}\.[0-9]{2}", r"[a-z]+@[a-z]+\.(com|org)"]
CHOICES = [["yes", "no", "maybe"], ["red", "green", "blue", "alice"],
           ["true", "false"]]
# EBNF (GBNF): both backends take it.
GRAMMARS = [
    'root ::= "name:" name " age:" age\nname ::= [a-z]+\nage ::= [0-9] [0-9]?',
    'root ::= item ("," item)*\nitem ::= "red" | "green" | "blue"',
]
PROMPT_TEXTS = ['{"name":"alice","age":', "yes no true false red green",
                '{"name":"bob","ok":true,"city":"', "abc-def_ghi.",
                "Output JSON: ", "The answer is "]
INVARIANT_METRIC = "vllm_patch_invariant_violations_total"


# ------------------------------------------------------------------ the mix
def load_schemas() -> list[tuple[str, dict]]:
    out = []
    for p in sorted(SCHEMAS.rglob("*.json")):
        try:
            out.append((str(p.relative_to(SCHEMAS)), json.loads(p.read_text())))
        except (OSError, ValueError):
            continue
    return out


_TOKENIZER: Any = None


def tokenizer() -> Any:
    global _TOKENIZER
    if _TOKENIZER is None:
        from transformers import AutoTokenizer

        from vllm_patch.testing.tiny_model import build_target

        _TOKENIZER = AutoTokenizer.from_pretrained(str(build_target()))
    return _TOKENIZER


def _prompt_ids(rng: random.Random, n: int) -> list[int]:
    tok = tokenizer()
    text = " ".join(rng.choice(PROMPT_TEXTS) for _ in range(max(1, n // 3 + 2)))
    ids = tok.encode(text, add_special_tokens=False)
    while len(ids) < n:
        ids += ids
    return ids[:n]


def make_request(seed: int, i: int, schemas: list[tuple[str, dict]],
                 max_tokens_cap: int = MAX_MODEL_LEN,
                 spec_decoding: bool = True, known_crashes: bool = False) -> dict:
    """Request i of stream `seed`: {"id", "api", "kind", "spec", "body"}.
    `body` is what goes to the client (extra_body merged by the sender).

    With speculative decoding on the CPU, top_k kills vLLM's engine (stock
    too: the rejection sampler applies top-k to the empty target logits of
    a step without drafts, `k.max()` of an empty tensor), so top_k is left
    out there unless `known_crashes`; the random draws stay the same."""
    rng = random.Random(seed * 1_000_003 + i)
    kind = rng.choices(["schema", "json_object", "regex", "choice", "grammar", "plain"],
                       [30, 8, 12, 12, 8, 30])[0]
    api = "chat" if rng.random() < 0.35 else "completions"
    stream = rng.random() < 0.4
    disconnect = stream and rng.random() < 0.15
    spec: Any = None
    extra: dict[str, Any] = {"return_token_ids": True}
    body: dict[str, Any] = {"model": MODEL}
    if kind == "schema":
        name, schema = schemas[rng.randrange(len(schemas))]
        spec = name
        if api == "chat" and rng.random() < 0.5:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "s", "schema": schema}}
        else:
            extra["structured_outputs"] = {"json": schema}
    elif kind == "json_object":
        if api == "chat":
            body["response_format"] = {"type": "json_object"}
        else:
            extra["structured_outputs"] = {"json_object": True}
    elif kind == "regex":
        spec = rng.choice(REGEXES)
        extra["structured_outputs"] = {"regex": spec}
    elif kind == "choice":
        spec = rng.choice(CHOICES)
        extra["structured_outputs"] = {"choice": spec}
    elif kind == "grammar":
        spec = rng.choice(GRAMMARS)
        extra["structured_outputs"] = {"grammar": spec}
    # sampling
    t = rng.choice([0.0, 0.0, 0.7, 1.0])
    body["temperature"] = t
    if t and rng.random() < 0.6:
        body["seed"] = rng.randrange(1 << 20)
    if t and rng.random() < 0.3:
        body["top_p"] = rng.choice([0.5, 0.9])
    if t and rng.random() < 0.3:
        top_k = rng.choice([1, 5, 20])
        if known_crashes or not spec_decoding:
            extra["top_k"] = top_k
    if t and rng.random() < 0.2:
        extra["min_p"] = rng.choice([0.05, 0.2])
    if rng.random() < 0.2:
        body["presence_penalty"] = rng.choice([0.5, 1.0])
        body["frequency_penalty"] = rng.choice([0.0, 0.5])
    if rng.random() < 0.15:
        extra["repetition_penalty"] = rng.choice([1.1, 1.3])
    lp = rng.random() < 0.35
    if lp:
        k = rng.choice([0, 1, 3])
        if api == "chat":
            body["logprobs"] = True
            body["top_logprobs"] = k
        else:
            body["logprobs"] = k
    if t and rng.random() < 0.12 and not disconnect:  # n > 1 needs sampling
        body["n"] = rng.choice([2, 3])
    if kind == "plain":
        if rng.random() < 0.25:
            body["stop"] = rng.sample(["}", " no", "red", "\n", ","], 2)
        if rng.random() < 0.15:
            extra["stop_token_ids"] = [rng.randrange(10, 200)]
        if rng.random() < 0.2:
            extra["min_tokens"] = rng.choice([1, 4, 8])  # capped by max_tokens below
    extra["ignore_eos"] = rng.random() < 0.3
    # lengths: prompt of 1 token .. near max_model_len
    size = rng.choices(["small", "mid", "large"], [55, 30, 15])[0]
    max_tokens = {"small": rng.randint(1, 16), "mid": rng.randint(17, 64),
                  "large": rng.randint(65, 300)}[size]
    max_tokens = min(max_tokens, max_tokens_cap)
    plen = rng.choices([1, rng.randint(2, 40), rng.randint(41, 200),
                        MAX_MODEL_LEN - max_tokens - rng.randint(1, 12)],
                       [10, 55, 25, 10])[0]
    plen = max(1, min(plen, MAX_MODEL_LEN - max_tokens - 40 if api == "chat"
                      else MAX_MODEL_LEN - max_tokens - 1))
    body["max_tokens"] = max_tokens
    if "min_tokens" in extra:
        extra["min_tokens"] = min(extra["min_tokens"], max_tokens)
    ids = _prompt_ids(rng, plen)
    if api == "chat":
        body["messages"] = [{"role": "user", "content": tokenizer().decode(ids)}]
    else:
        body["prompt"] = ids if rng.random() < 0.7 else tokenizer().decode(ids)
    body["stream"] = stream
    body["extra_body"] = extra
    return {"id": f"{seed}-{i}", "api": api, "kind": kind, "spec": spec,
            "disconnect": disconnect, "body": body}


def concurrency(seed: int, i: int) -> int:
    """The stream's concurrency around request i: changes every 16 requests."""
    return random.Random(seed * 7919 + i // 16).choice([1, 2, 4, 8, 16, 32])


# ---------------------------------------------------------------- checkers
class Replayer:
    """The request's own grammar backend (vLLM's XgrammarBackend /
    GuidanceBackend on the tiny model's tokenizer, as the server builds it):
    decides which grammars the backend rejects and replays output token ids."""

    def __init__(self, backend: str) -> None:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        from vllm.config import ModelConfig, StructuredOutputsConfig, VllmConfig
        from vllm.v1.structured_output import StructuredOutputManager

        from vllm_patch.testing.tiny_model import build_target

        path = str(build_target())
        mc = ModelConfig(model=path, tokenizer=path, dtype="float32", seed=0,
                         max_model_len=MAX_MODEL_LEN)
        self.cfg = VllmConfig(model_config=mc, structured_outputs_config=
                              StructuredOutputsConfig(backend=backend,
                                                      disable_any_whitespace=True))
        self.name = backend
        # the replay refuses tokens on purpose: the backends' per-token error
        # lines are not news here
        import logging

        logging.getLogger("vllm.v1.structured_output").setLevel(logging.CRITICAL)
        self.tok = StructuredOutputManager(self.cfg).tokenizer
        vocab = mc.get_vocab_size()
        if backend == "xgrammar":
            from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend as B
        else:
            from vllm.v1.structured_output.backend_guidance import GuidanceBackend as B
        self.backend = B(self.cfg, tokenizer=self.tok, vocab_size=vocab)
        self._rejects: dict[str, tuple[bool, Any]] = {}
        # what the engine passes as the grammar's stop tokens for a request
        # without stop_token_ids (SamplingParams.all_stop_token_ids): the
        # generation config's eos ids
        import inspect

        gen = mc.try_get_generation_config().get("eos_token_id", self.tok.eos_token_id)
        self.stop_ids = {gen} if isinstance(gen, int) else set(gen)
        self.stop_ids.add(self.tok.eos_token_id)
        self._stop_kw = ({"stop_token_ids": self.stop_ids} if "stop_token_ids" in
                         inspect.signature(self.backend.compile_grammar).parameters else {})

    @staticmethod
    def so_params(req: dict) -> Any:
        from vllm.sampling_params import StructuredOutputsParams

        body, extra = req["body"], req["body"]["extra_body"]
        so = extra.get("structured_outputs")
        rf = body.get("response_format")
        if rf and rf["type"] == "json_schema":
            so = {"json": rf["json_schema"]["schema"]}
        elif rf and rf["type"] == "json_object":
            so = {"json_object": True}
        return StructuredOutputsParams(**so) if so else None

    def prepare(self, req: dict) -> tuple[bool, Any]:
        """(the backend refuses this request's grammar, the structured-output
        params as the front end hands them to the engine: vLLM's own
        validation, which also rewrites e.g. a choice for xgrammar)."""
        so = self.so_params(req)
        if so is None:
            return False, None
        key = json.dumps(dataclasses.asdict(so), sort_keys=True, default=str)
        if key not in self._rejects:
            from vllm.sampling_params import SamplingParams
            from vllm.v1.structured_output.request import get_structured_output_key

            try:
                sp = SamplingParams(structured_outputs=so, max_tokens=1)
                if self.name == "xgrammar":
                    from vllm.v1.structured_output.backend_xgrammar import (
                        validate_xgrammar_grammar,
                    )
                    validate_xgrammar_grammar(sp)
                else:
                    from vllm.v1.structured_output.backend_guidance import (
                        validate_guidance_grammar,
                    )
                    validate_guidance_grammar(sp, tokenizer=self.backend.ll_tokenizer)
                so = sp.structured_outputs
                self.backend.compile_grammar(*get_structured_output_key(so),
                                             **self._stop_kw)
                self._rejects[key] = (False, so)
            except Exception:  # noqa: BLE001 - any refusal counts
                self._rejects[key] = (True, None)
        return self._rejects[key]

    def rejects(self, req: dict) -> bool:
        """True when the backend refuses the grammar (the front end must
        answer 400)."""
        return self.prepare(req)[0]

    def replay(self, req: dict, ids: list[int]) -> tuple[int, int | None]:
        """(tokens after the grammar's end, index of the first token the
        grammar refuses or None)."""
        from vllm.v1.structured_output.request import get_structured_output_key

        g = self.backend.compile_grammar(*get_structured_output_key(self.prepare(req)[1]),
                                         **self._stop_kw)
        matcher = getattr(g, "ll_matcher", None)  # guidance: stopped = complete
        for j, t in enumerate(ids):
            if g.is_terminated():
                return len(ids) - j, None
            if matcher is not None and matcher.is_stopped() and t not in self.stop_ids:
                return 0, j
            if not g.accept_tokens(req["id"], [t]):
                return 0, j
            if t in self.stop_ids:  # the grammar took its end here
                return len(ids) - j - 1, None
        return 0, None


def check_text(req: dict, text: str, schema: Any) -> str | None:
    """The failure kind of a text that finished `stop`, or None."""
    kind = req["kind"]
    if kind in ("schema", "json_object"):
        import jsonschema

        try:
            obj = json.loads(text)
            if kind == "schema":
                jsonschema.validate(obj, schema)
            elif not isinstance(obj, dict):
                return "invalid_json"
        except jsonschema.SchemaError:
            return None  # the schema itself is not valid draft JSON Schema
        except (ValueError, jsonschema.ValidationError, RecursionError):
            return "invalid_json"
        return None
    if kind == "regex":
        return None if re.fullmatch(req["spec"], text) else "invalid_output"
    if kind == "choice":
        return None if text in req["spec"] else "invalid_output"
    return None  # grammar: the replay decides; plain: nothing to validate


def _lp_rows(api: str, lp: Any) -> tuple[int, int]:
    """(rows, max top entries per row) of a choice's logprobs."""
    if lp is None:
        return 0, 0
    if api == "chat":
        content = lp.content or []
        return len(content), max((len(c.top_logprobs or []) for c in content), default=0)
    tops = lp.top_logprobs or []
    return len(lp.tokens or []), max((len(t or {}) for t in tops), default=0)


def check_choices(req: dict, choices: dict[int, dict], replayer: Replayer | None,
                  schema: Any) -> list[str]:
    body, extra = req["body"], req["body"]["extra_body"]
    fails: list[str] = []
    n = body.get("n", 1)
    if len(choices) != n and not req["disconnect"]:
        fails.append("n_mismatch")
    for c in choices.values():
        ids, fin = c["ids"], c["finish"]
        if req["disconnect"]:
            continue
        if fin not in ("stop", "length"):
            fails.append(f"finish_{fin}")
        if len(ids) > body["max_tokens"]:
            fails.append("too_many_tokens")
        want_lp = body.get("logprobs")
        if want_lp is not None and want_lp is not False:
            k = body.get("top_logprobs", 0) if req["api"] == "chat" else want_lp
            rows, top = c["lp_rows"], c["lp_top"]
            # completions list the sampled token besides the top k
            if rows != len(ids) or top > k + 1:
                fails.append("logprobs_misaligned")
        structured = req["kind"] != "plain"
        grammar_ok = False
        if structured and replayer is not None and ids:
            post, bad = replayer.replay(req, ids)
            if post:
                fails.append("post_grammar")
            if bad is not None:
                fails.append("grammar_rejected")
            grammar_ok = not post and bad is None and ids[-1] in replayer.stop_ids
        if structured and fin == "stop":
            k = check_text(req, c["text"], schema)
            if k == "invalid_json" and grammar_ok and req["kind"] == "schema":
                # every token was the grammar's and it ended there: the
                # backend's grammar admits JSON the schema refuses
                k = "schema_looser_than_grammar"
            if k:
                fails.append(k)
    return sorted(set(fails))


# ----------------------------------------------------------------- sending
async def send(client: Any, req: dict) -> dict:
    """One request with the official client; the raw outcome."""
    import openai

    body = dict(req["body"])
    chat = req["api"] == "chat"
    create = client.chat.completions.create if chat else client.completions.create
    choices: dict[int, dict] = {}

    def slot(idx: int) -> dict:
        return choices.setdefault(idx, {"text": "", "ids": [], "finish": None,
                                        "lp_rows": 0, "lp_top": 0})

    def take(ch: Any) -> None:
        s = slot(ch.index)
        if chat:
            msg = getattr(ch, "delta", None) or getattr(ch, "message", None)
            s["text"] += (msg.content or "") if msg is not None else ""
        else:
            s["text"] += ch.text or ""
        s["ids"] += list(getattr(ch, "token_ids", None) or [])
        s["finish"] = ch.finish_reason or s["finish"]
        rows, top = _lp_rows(req["api"], ch.logprobs)
        s["lp_rows"] += rows
        s["lp_top"] = max(s["lp_top"], top)

    t0 = time.monotonic()
    out: dict[str, Any] = {"status": 200}
    try:
        if body.get("stream"):
            stream = await create(**body)
            chunks = 0
            try:
                async for ev in stream:
                    chunks += 1
                    for ch in ev.choices:
                        take(ch)
                    if req["disconnect"] and chunks >= 2:
                        break
            finally:
                await stream.close()
        else:
            resp = await create(**body)
            for ch in resp.choices:
                take(ch)
    except openai.APIStatusError as e:
        out["status"] = e.status_code
        out["error"] = str(e)[:300]
    except (openai.APIConnectionError, openai.APITimeoutError) as e:
        out["status"] = None
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    except openai.APIError as e:  # an error event inside a 200 stream
        # vLLM validates a streamed request once the stream has begun: a
        # refusal comes as an error event carrying the 400 (HTTP status 200)
        code = (e.body or {}).get("code") if isinstance(e.body, dict) else None
        out["status"] = "400-in-stream" if code == 400 else "stream_error"
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    out["choices"] = choices
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


def refused_by_vllm(req: dict, spec_decoding: bool) -> bool:
    """Requests vLLM refuses by design (a 400 is the right answer): min_p
    with speculative decoding."""
    return spec_decoding and "min_p" in req["body"]["extra_body"]


def judge(req: dict, out: dict, replayer: Replayer | None,
          schema: Any, spec_decoding: bool = True) -> list[str]:
    status = out["status"]
    expect_reject = (replayer is not None and replayer.rejects(req)) \
        or refused_by_vllm(req, spec_decoding)
    if status is None:
        return ["http_error"]
    if status == "stream_error":
        return ["stream_error"]
    if status == "400-in-stream":
        status = 400
    if status >= 500:
        return ["http_5xx"]
    if 400 <= status < 500:
        return [] if expect_reject else ["unexpected_4xx"]
    if expect_reject:
        return ["rejected_not_4xx"]
    return check_choices(req, out["choices"], replayer, schema)


# ----------------------------------------------------------------- targets
def _metrics(url: str) -> dict[str, float]:
    from vllm_patch.launch.router import parse_metrics

    with urllib.request.urlopen(url + "/metrics", timeout=20) as r:
        return parse_metrics(r.read().decode())


class Target:
    """Something that serves the OpenAI API: `url` (the front door) and
    `instances` (the vLLM servers' base URLs, for /metrics)."""

    url: str = ""
    instances: list[str] = []

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def alive(self) -> bool:
        return True


def server_env(mode: str, sched: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                "VLLM_PATCH_CHECK_INVARIANTS": "1", "VLLM_PATCH_INVARIANTS_RAISE": "0"})
    env.pop("VLLM_PATCH_DISABLE", None)
    env.pop("VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING", None)
    if mode == "stock":
        env["VLLM_PATCH_DISABLE"] = "1"
    if sched == "async":
        env["VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING"] = "1"
    return env


def spec_args(spec: str, k: int) -> list[str]:
    from vllm_patch.testing import tiny_model

    if spec == "none":
        return []
    model = (tiny_model.build_target() if spec == "draft_model"
             else tiny_model.build_eagle(trained=True))
    return ["--speculative-config", json.dumps(
        {"method": spec, "model": str(model), "num_speculative_tokens": k})]


def vllm_args(backend: str, spec: str, k: int, max_num_seqs: int) -> list[str]:
    from vllm_patch.testing.pd_pair import tiny_vllm_args
    from vllm_patch.testing.tiny_model import build_target

    return (tiny_vllm_args(str(build_target()), block_size=32, spec_k=None,
                           max_num_seqs=max_num_seqs)
            + ["--structured-outputs-config",
               json.dumps({"backend": backend, "disable_any_whitespace": True})]
            + spec_args(spec, k))


class OneServer(Target):
    """`python -m vllm.entrypoints.openai.api_server` on the tiny model."""

    def __init__(self, a: argparse.Namespace, log_dir: Path) -> None:
        from vllm_patch.launch.supervisor import free_port
        from vllm_patch.testing.tiny_model import build_target

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.instances = [self.url]
        self.cmd = ([sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                     "--host", "127.0.0.1", "--port", str(self.port),
                     "--model", str(build_target()), "--served-model-name", MODEL]
                    + vllm_args(a.backend, a.spec, a.k, a.max_num_seqs))
        self.env = server_env(a.mode, a.sched)
        self.log_path = log_dir / f"server-{int(time.time())}.log"
        self.timeout = a.start_timeout
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        from vllm_patch.testing.pd_pair import Server, wait_healthy

        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        shim = Server.__new__(Server)  # pd_pair's health wait on our process
        shim.role, shim.proc, shim.url, shim.log_path = "server", self.proc, self.url, \
            self.log_path
        wait_healthy([shim], self.timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        from vllm_patch.launch.supervisor import kill_group

        if self.proc is not None:
            kill_group(self.proc.pid, 20.0, self.proc)
            self._log.close()


class Launched(Target):
    """A P/D pair behind the router, started by `vllm-patch launch`."""

    def __init__(self, a: argparse.Namespace, log_dir: Path) -> None:
        from vllm_patch.launch.supervisor import free_port
        from vllm_patch.testing.tiny_model import build_target

        self.ready = log_dir / f"ready-{int(time.time())}.json"
        self.ready.unlink(missing_ok=True)
        port = free_port()
        args = vllm_args(a.backend, a.spec, a.k, a.max_num_seqs)
        if a.connector == "NixlConnector":
            extra = json.dumps({"kv_lease_duration": 300})
        else:
            # the launcher keeps its KV files in a subfolder of this one
            (log_dir / "kv").mkdir(parents=True, exist_ok=True)
            extra = json.dumps({"shared_storage_path": str(log_dir / "kv")})
        self.cmd = [sys.executable, "-m", "vllm_patch.cli", "launch",
                    "--model", str(build_target()), "--served-model-name", MODEL,
                    "--connector", a.connector, "--kv-connector-extra-config", extra,
                    "--host", "127.0.0.1", "--port", str(port),
                    "--log-dir", str(log_dir / "logs"), "--ready-file", str(self.ready),
                    "--max-restarts", "3", "--start-timeout", str(a.start_timeout),
                    "--"] + args
        self.env = server_env(a.mode, a.sched)
        if a.connector == "NixlConnector":
            self.env.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
            self.env["VLLM_PATCH_NIXL_CPU_CORE_IN_BIND"] = "1"
        self.log_path = log_dir / f"launch-{int(time.time())}.log"
        self.timeout = a.start_timeout + 120
        self.proc: subprocess.Popen | None = None
        self.pids: list[int] = []

    def start(self) -> None:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("vllm-patch launch did not come up:\n" + "\n".join(
                    self.log_path.read_text(errors="replace").splitlines()[-30:]))
            time.sleep(2)
        time.sleep(0.5)
        info = json.loads(self.ready.read_text())
        self.url = info["url"]
        self.instances = [i["url"] for i in info["instances"]]

    def alive(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        text = self.log_path.read_text(errors="replace")
        return "restarted (" not in text  # the launcher's progress line

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGINT)  # the launcher tears down
            self.proc.wait(120)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            from vllm_patch.launch.supervisor import kill_group

            kill_group(self.proc.pid, 20.0, self.proc)
        self._log.close()


class External(Target):
    def __init__(self, url: str, instances: list[str]) -> None:
        self.url = url.rstrip("/")
        self.instances = instances or [self.url]


# -------------------------------------------------------------- run checks
def start_times(target: Target) -> dict[str, float | None]:
    out = {}
    for u in target.instances:
        try:
            out[u] = _metrics(u).get("process_start_time_seconds")
        except OSError:
            out[u] = None
    return out


def invariant_count(target: Target) -> float:
    total = 0.0
    for u in target.instances:
        try:
            total += _metrics(u).get(INVARIANT_METRIC, 0.0)
        except OSError:
            pass
    return total


async def wait_idle(target: Target, timeout_s: float = 40.0) -> dict[str, dict]:
    """Poll every instance until no KV block is in use and nothing runs or
    waits (the gauges refresh once per logging interval)."""
    keys = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
            "vllm:num_requests_waiting")
    deadline = time.monotonic() + timeout_s
    while True:
        state: dict[str, dict] = {}
        for u in target.instances:
            try:
                m = await asyncio.to_thread(_metrics, u)
                state[u] = {k: m.get(k) for k in keys}
            except OSError as e:
                state[u] = {"error": str(e)}
        if all(v == 0 for s in state.values() for v in s.values()) \
                or time.monotonic() > deadline:
            return state
        await asyncio.sleep(1.0)


def idle_ok(state: dict[str, dict]) -> bool:
    return all(v == 0 for s in state.values() for v in s.values())


# --------------------------------------------------------------------- run
@dataclasses.dataclass
class RunConfig:
    out: Path
    seed: int = 0
    requests: int = 200
    duration: float | None = None
    backend: str = "xgrammar"
    mode: str = "patched"
    max_tokens_cap: int = MAX_MODEL_LEN
    idle_every: int = 250
    progress_s: float = 10.0
    timeout_s: float = 300.0
    spec_decoding: bool = True
    known_crashes: bool = False


def load_records(path: Path) -> dict[str, dict]:
    recs: dict[str, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
                recs[r["id"]] = r
            except (ValueError, KeyError):
                continue
    return recs


async def run_stream(target: Target, rc: RunConfig,
                     print_fn: Any = print) -> dict:
    """Send the seeded stream (skipping ids already in rc.out/records.jsonl),
    check everything, write records and summary.json; returns the summary."""
    import openai

    rc.out.mkdir(parents=True, exist_ok=True)
    rec_path = rc.out / "records.jsonl"
    done = load_records(rec_path)
    schemas = load_schemas()
    schema_by_name = dict(schemas)
    replayer = await asyncio.to_thread(Replayer, rc.backend)
    client = openai.AsyncOpenAI(base_url=target.url + "/v1", api_key="unused",
                                max_retries=0, timeout=rc.timeout_s)
    starts0 = await asyncio.to_thread(start_times, target)
    inv0 = await asyncio.to_thread(invariant_count, target)
    run_fails: list[dict] = []
    fails = collections.Counter()
    count = [0, 0]  # sent this run, finished this run
    t0 = time.monotonic()
    inflight: set[asyncio.Task] = set()
    fh = open(rec_path, "a")

    async def one(req: dict) -> None:
        out = await send(client, req)
        schema = schema_by_name.get(req["spec"]) if req["kind"] == "schema" else None
        try:
            kinds = await asyncio.to_thread(judge, req, out, replayer, schema,
                                            rc.spec_decoding)
        except Exception as e:  # noqa: BLE001 - recorded, the stream goes on
            kinds = ["checker_error"]
            out["error"] = f"checker: {type(e).__name__}: {e}"[:300]
        rec = {"id": req["id"], "mode": rc.mode, "api": req["api"], "kind": req["kind"],
               "status": out["status"], "fails": kinds, "seconds": out["seconds"],
               "finish": [c["finish"] for c in out["choices"].values()],
               "tokens": [len(c["ids"]) for c in out["choices"].values()]}
        if kinds:
            rec["detail"] = {"error": out.get("error"), "choices": out["choices"]}
            rec["request"] = req
        fh.write(json.dumps(rec) + "\n")
        fh.flush()
        fails.update(kinds)
        count[1] += 1

    async def progress() -> None:
        while True:
            await asyncio.sleep(rc.progress_s)
            el = time.monotonic() - t0
            print_fn(f"soak {rc.mode}: {count[1]} done ({len(done)} earlier), "
                     f"{len(inflight)} in flight, failures {sum(fails.values())} "
                     f"{dict(fails)}, {count[1] / el:.2f} req/s", flush=True)

    async def drain_and_check(tag: str) -> None:
        if inflight:
            await asyncio.wait(inflight)
        state = await wait_idle(target)
        if not idle_ok(state):
            run_fails.append({"kind": "kv_not_idle", "at": tag, "state": state})
            print_fn(f"soak {rc.mode}: NOT IDLE at {tag}: {state}", flush=True)

    prog = asyncio.create_task(progress())
    try:
        for i in range(rc.requests):
            if rc.duration is not None and time.monotonic() - t0 > rc.duration:
                break
            rid = f"{rc.seed}-{i}"
            if rid in done:
                continue
            req = make_request(rc.seed, i, schemas, rc.max_tokens_cap,
                               rc.spec_decoding, rc.known_crashes)
            while len(inflight) >= concurrency(rc.seed, i):
                _, _ = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
            task = asyncio.create_task(one(req))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
            count[0] += 1
            if rc.idle_every and count[0] % rc.idle_every == 0:
                await drain_and_check(f"request {i}")
            if not target.alive():
                run_fails.append({"kind": "server_restarted", "at": f"request {i}"})
                break
        await drain_and_check("end")
    finally:
        prog.cancel()
        fh.close()
        await client.close()
    starts1 = await asyncio.to_thread(start_times, target)
    if not target.alive() or starts1 != starts0:
        if not any(f["kind"] == "server_restarted" for f in run_fails):
            run_fails.append({"kind": "server_restarted", "before": starts0,
                              "after": starts1})
    inv = await asyncio.to_thread(invariant_count, target) - inv0
    if inv:
        run_fails.append({"kind": "invariant_violations", "count": inv})
    wall = time.monotonic() - t0
    recs = load_records(rec_path)
    summary = summarize(recs, run_fails)
    summary.update(mode=rc.mode, seed=rc.seed, backend=rc.backend,
                   wall_s=round(wall, 1), sent_this_run=count[0],
                   s_per_100=round(100 * wall / max(count[0], 1), 1))
    # run-level failures of earlier (resumed) runs are kept
    old = rc.out / "summary.json"
    if old.exists():
        prev = json.loads(old.read_text()).get("run_failures", [])
        summary["run_failures"] = prev + run_fails
    (rc.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def summarize(recs: dict[str, dict], run_fails: list[dict]) -> dict:
    by_kind = collections.Counter(k for r in recs.values() for k in r["fails"])
    finish = collections.Counter(f for r in recs.values() for f in r["finish"])
    status = collections.Counter(str(r["status"]) for r in recs.values())
    return {"requests": len(recs),
            "failed_requests": sum(bool(r["fails"]) for r in recs.values()),
            "failures": dict(by_kind), "finish": dict(finish), "status": dict(status),
            "run_failures": run_fails}


# -------------------------------------------------------------------- diff
def diff(stock_dir: Path, patched_dir: Path) -> dict:
    """Stock vs patched runs of the same seed: failure kind x mode, the
    patched-only failures (defects) and the stock-too ones (upstream)."""
    s, p = load_records(stock_dir / "records.jsonl"), load_records(patched_dir / "records.jsonl")
    runs = {}
    for name, d in (("stock", stock_dir), ("patched", patched_dir)):
        f = d / "summary.json"
        runs[name] = json.loads(f.read_text()).get("run_failures", []) if f.exists() else []
    common = sorted(set(s) & set(p), key=lambda x: int(x.rsplit("-", 1)[1]))
    table: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"stock": 0, "patched": 0})
    patched_only, stock_too, stock_only = [], [], []
    for rid in common:
        sk, pk = set(s[rid]["fails"]), set(p[rid]["fails"])
        for k in sk:
            table[k]["stock"] += 1
        for k in pk:
            table[k]["patched"] += 1
        if pk - sk:
            patched_only.append({"id": rid, "kinds": sorted(pk - sk),
                                 "request": p[rid].get("request")})
        if pk & sk:
            stock_too.append({"id": rid, "kinds": sorted(pk & sk),
                              "request": p[rid].get("request")})
        if sk - pk:
            stock_only.append({"id": rid, "kinds": sorted(sk - pk)})
    for name, rf in runs.items():
        for f in rf:
            table["run:" + f["kind"]][name] += 1
    run_patched_only = sorted({f["kind"] for f in runs["patched"]}
                              - {f["kind"] for f in runs["stock"]})
    return {"compared": len(common), "table": {k: dict(v) for k, v in sorted(table.items())},
            "patched_only": patched_only, "stock_too": stock_too,
            "stock_only": stock_only, "run_patched_only": run_patched_only}


def format_diff(d: dict) -> str:
    lines = [f"{d['compared']} requests in both runs",
             f"{'failure kind':28s} {'stock':>7s} {'patched':>8s}"]
    for k, v in d["table"].items():
        lines.append(f"{k:28s} {v['stock']:7d} {v['patched']:8d}")
    if not d["table"]:
        lines.append("(no failure in either run)")
    lines.append(f"patched-only failures (defects): {len(d['patched_only'])}"
                 + (f" + run-level {d['run_patched_only']}" if d["run_patched_only"] else ""))
    for f in d["patched_only"][:20]:
        lines.append(f"  {f['id']} {f['kinds']}")
    lines.append(f"failures stock shows too (upstream): {len(d['stock_too'])}")
    for f in d["stock_too"][:20]:
        r = f["request"] or {}
        lines.append(f"  {f['id']} {f['kinds']} repro: {r.get('api')} "
                     f"{json.dumps(r.get('body'))[:300]}")
    lines.append(f"stock-only failures (removed by the patch): {len(d['stock_only'])}")
    return "\n".join(lines)


# --------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m vllm_patch.testing.soak",
                                 description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="send the seeded stream and check every answer")
    r.add_argument("--out", required=True, help="records.jsonl + summary.json (resumable)")
    r.add_argument("--mode", choices=("stock", "patched"), default="patched")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--requests", type=int, default=200)
    r.add_argument("--duration", type=float, default=None, help="seconds")
    r.add_argument("--target", choices=("server", "pd"), default="server")
    r.add_argument("--url", help="use a running server (no start); --instance for /metrics")
    r.add_argument("--instance", action="append", default=[])
    r.add_argument("--connector", default="ExampleConnector",
                   choices=("ExampleConnector", "NixlConnector"))
    r.add_argument("--backend", choices=("xgrammar", "guidance"), default="xgrammar")
    r.add_argument("--spec", choices=("draft_model", "eagle", "none"), default="draft_model")
    r.add_argument("--k", type=int, default=3)
    r.add_argument("--sched", choices=("async", "sync"), default="async")
    r.add_argument("--max-num-seqs", type=int, default=16)
    r.add_argument("--max-tokens-cap", type=int, default=MAX_MODEL_LEN)
    r.add_argument("--idle-every", type=int, default=250)
    r.add_argument("--start-timeout", type=float, default=600.0)
    r.add_argument("--known-crashes", action="store_true",
                   help="keep requests known to kill stock vLLM too (top_k with "
                        "speculative decoding on the CPU)")
    d = sub.add_parser("diff", help="differential table of a stock and a patched run")
    d.add_argument("stock")
    d.add_argument("patched")
    d.add_argument("--json", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.cmd == "diff":
        d = diff(Path(a.stock), Path(a.patched))
        print(json.dumps(d, indent=1) if a.json else format_diff(d))
        return 1 if d["patched_only"] or d["run_patched_only"] else 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.url:
        target: Target = External(a.url, a.instance)
    elif a.target == "pd":
        target = Launched(a, out)
    else:
        target = OneServer(a, out)
    (out / "config.json").write_text(json.dumps(vars(a), indent=1))

    def _terminate(signum: int, frame: Any) -> None:
        # SIGTERM / SIGHUP (a timeout, a campaign stopped): unwind, so the
        # finally below stops the servers this run started.
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)
    t0 = time.monotonic()
    try:
        target.start()
        print(f"soak {a.mode}: {a.target} up in {time.monotonic() - t0:.0f}s "
              f"at {target.url}", flush=True)
        rc = RunConfig(out=out, seed=a.seed, requests=a.requests, duration=a.duration,
                       backend=a.backend, mode=a.mode, max_tokens_cap=a.max_tokens_cap,
                       idle_every=a.idle_every, spec_decoding=a.spec != "none",
                       known_crashes=a.known_crashes)
        summary = asyncio.run(run_stream(target, rc))
    finally:
        target.stop()
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
