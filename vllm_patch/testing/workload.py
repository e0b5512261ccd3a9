"""Structured P/D workload for G4 end-to-end tests and demos.

`build_requests()` builds the mixed batch (JSON schemas, loose JSON, choice,
regex; completions and chat; ignore_eos true/false; streaming and not; a
unique >= 2-block prompt each, so every request's KV travels P -> D);
`run_batch(pd)` sends it through the router (8 concurrent) and returns the
per-request checks and metric deltas; `wait_idle(pd)` polls both instances
until no KV block is used and nothing runs or waits.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import re
import time
from typing import Any

from vllm_patch.testing import engine
from vllm_patch.testing.engine import TERMINALS, post_grammar  # noqa: F401 (re-exported)
CHOICES = ["yes", "no", "maybe"]
REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
SCHEMA2 = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["paris", "oslo", "lima"]},
                   "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                        "maximum": 9}, "maxItems": 3}},
    "required": ["city", "items"],
    "additionalProperties": False,
}
# "json_loose": optional properties in the tiny model's training order, bounded
# strings; the draft model's greedy continuation mostly passes this grammar,
# so structured steps really carry accepted drafts (with the tight schemas the
# drafts are mostly grammar-invalid). ({"type": "object"} lets the tiny model
# write a never-ending key string: finish "length", no use here.)
JSON_LOOSE = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "ok": {"type": "boolean"},
                   "city": {"type": "string", "maxLength": 8}},
    "additionalProperties": False,
}
KINDS = {"json": engine.JSON_SCHEMA, "json2": SCHEMA2, "json_loose": JSON_LOOSE,
         "choice": CHOICES, "regex": REGEX}
MAX_TOKENS = 64
BLOCK = 32


def prompt(i: int) -> str:
    # >= 2 blocks of 32 tokens (tiny BPE tokenizer), unique per request
    base = engine.PROMPTS[i % len(engine.PROMPTS)]
    return (f"request {i}: " + '{"name":"carol","age":%d,"ok":false} ' % i * 6 + base)


def build_requests() -> list[dict]:
    reqs = []
    i = 0
    for ignore_eos in (True, False):
        for stream in (False, True):
            for kind in KINDS:
                for chat in ((False, True) if kind in ("json", "choice") else (False,)):
                    for _ in range(1 if chat else 2 if kind == "json_loose" else 3):
                        reqs.append(dict(i=i, kind=kind, ignore_eos=ignore_eos,
                                         stream=stream, chat=chat))
                        i += 1
    return reqs


def make_body(r: dict) -> tuple[str, dict]:
    kind, spec = r["kind"], KINDS[r["kind"]]
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": r["ignore_eos"], "stream": r["stream"],
            "return_token_ids": True}
    so = {"json": spec} if kind.startswith("json") else {kind: spec}
    if r["chat"]:
        body["messages"] = [{"role": "user", "content": prompt(r["i"])}]
        if kind.startswith("json"):
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": kind, "schema": spec}}
        else:
            body["structured_outputs"] = so
        return "/v1/chat/completions", body
    body["prompt"] = prompt(r["i"])
    body["structured_outputs"] = so
    return "/v1/completions", body


def send(url: str, r: dict) -> dict:
    import requests

    path, body = make_body(r)
    resp = requests.post(url + path, json=body, stream=r["stream"], timeout=300)
    assert resp.status_code == 200, resp.text
    text, ids, finish = "", [], None
    if not r["stream"]:
        c = resp.json()["choices"][0]
        text = c["message"]["content"] if r["chat"] else c["text"]
        return dict(text=text or "", ids=c.get("token_ids") or [], finish=c["finish_reason"])
    for line in resp.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[6:])
        for c in ev.get("choices", []):
            text += (c.get("delta", {}).get("content") if r["chat"] else c.get("text")) or ""
            ids += c.get("token_ids") or []
            finish = c.get("finish_reason") or finish
    return dict(text=text, ids=ids, finish=finish)


def prefill_half(pd: Any, path: str, body: dict) -> dict | None:
    """The router's first half, sent by hand to the prefill instance: its
    `kv_transfer_params` (None when it returned none). Raises on a non-200."""
    import requests

    from vllm_patch.launch import router as proxy

    pre = requests.post(pd.server("prefill").url + path,
                        json=proxy.prefill_body(body, chat=path.endswith("chat/completions")),
                        timeout=120)
    if pre.status_code != 200:
        raise RuntimeError(f"prefill answered {pre.status_code}: {pre.text[:300]}")
    return pre.json().get("kv_transfer_params")


def decode_half(pd: Any, path: str, body: dict, params: dict | None,
                timeout: float = 180, **kw: Any):
    """The router's second half, by hand: the request plus `params` to the
    decode instance (a requests.Response; `stream=True` passes through)."""
    import requests

    from vllm_patch.launch import router as proxy

    return requests.post(pd.server("decode").url + path,
                         json=proxy.decode_body(body, params), timeout=timeout, **kw)


def valid(kind: str, text: str) -> bool:
    import jsonschema

    try:
        if kind.startswith("json"):
            jsonschema.validate(json.loads(text), KINDS[kind])
            return True
        if kind == "choice":
            return text in CHOICES
        return re.fullmatch(REGEX, text) is not None
    except (ValueError, jsonschema.ValidationError):
        return False


def wait_idle(pd, timeout_s: float = 30.0,
              roles: tuple[str, ...] = ("prefill", "decode")) -> dict:
    """Each of `roles`: no KV block in use, nothing running or waiting. The
    gauges are refreshed once per logging interval, hence the polling."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = {role: {k: pd.metrics(role).get(k) for k in (
            "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
            "vllm:num_requests_waiting")} for role in roles}
        if all(v == 0 for s in state.values() for v in s.values()) \
                or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def run_batch(pd: Any, reqs: list[dict] | None = None, workers: int = 8) -> dict:
    """Send the batch through the router; check every answer."""
    reqs = reqs if reqs is not None else build_requests()
    m0 = pd.metrics("decode")
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(workers) as ex:
        outs = list(ex.map(lambda r: send(pd.url, r), reqs))
    wall = time.monotonic() - t0
    dm = pd.metrics("decode")
    delta = {k: dm.get(k, 0) - m0.get(k, 0) for k in dm}
    problems: dict[bool, list[str]] = {True: [], False: []}
    counts: collections.Counter = collections.Counter()
    for r, o in zip(reqs, outs):
        bad = engine.tally(counts, valid(r["kind"], o["text"]), o["text"], o["ids"],
                           o["finish"])
        if bad:
            problems[r["ignore_eos"]].append(f"{r}: {'; '.join(bad)}")
    return dict(reqs=reqs, outs=outs, wall=wall, delta=delta, problems=problems,
                counts=counts, idle=wait_idle(pd))


def summary(label: str, res: dict) -> str:
    c, d, p = res["counts"], res["delta"], res["problems"]
    return (f"{label}: {len(res['reqs'])} requests in {res['wall']:.1f}s, valid {c['valid']}, "
            f"post-grammar tokens {c['post_grammar_tokens']}, "
            f"{ {k: v for k, v in c.items() if k.startswith('finish')} }, failing "
            f"ignore_eos={len(p[True])} no-ignore_eos={len(p[False])}, decode external "
            f"prefix hits {d.get('vllm:external_prefix_cache_hits_total', 0):.0f} tokens, "
            f"spec decode drafts {d.get('vllm:spec_decode_num_drafts_total', 0):.0f} "
            f"draft tokens {d.get('vllm:spec_decode_num_draft_tokens_total', 0):.0f} "
            f"accepted {d.get('vllm:spec_decode_num_accepted_tokens_total', 0):.0f}, "
            f"idle {res['idle']}")


def is_idle(state: dict) -> bool:
    return all(v == 0 for s in state.values() for v in s.values())
