"""`vllm-patch launch` across three network namespaces: Ray head and router
on node A (198.18.0.11), prefill on B, decode on C by custom resources,
ExampleConnector over a folder every node sees. The official `openai`
client sends concurrent streaming and non-streaming structured requests
(JSON schema, regex, choice) to A's address; the decode node's link goes
down for 20 s under load; SIGINT to the launcher then stops every server on
every node, removes the deployment's KV folder in the shared folder (the
user's own file there stays) and leaves the cluster (given with --address)
running."""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from vllm_patch.launch.router import parse_metrics
from vllm_patch.testing import workload as wl

ROUTER_PORT = 8000
REQUEST_BOUND_S = 240


def _launch(c, connector_args: list[str]):
    from vllm_patch.testing import tiny_model
    from vllm_patch.testing.pd_pair import tiny_vllm_args

    model = str(tiny_model.build_target())
    ready = c.root / "ready.json"
    a = c.nodes["A"]
    p = c.spawn("A", ["vllm-patch", "launch", "--address", c.address, "--model", model,
                      "--served-model-name", "tiny", *connector_args,
                      "--prefill-resource", "prefill", "--decode-resource", "decode",
                      "--host", a.ip, "--port", str(ROUTER_PORT), "--max-restarts", "2",
                      "--start-timeout", "400", "--ready-file", str(ready),
                      "--", *tiny_vllm_args(model, spec_k=3)], "launch.log")
    deadline = time.monotonic() + 480
    while not ready.exists():
        assert p.poll() is None, (c.root / "launch.log").read_text()[-3000:]
        assert time.monotonic() < deadline, (c.root / "launch.log").read_text()[-3000:]
        time.sleep(2)
    time.sleep(0.5)
    return p, json.loads(ready.read_text())


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=REQUEST_BOUND_S,
                         max_retries=0)


# JSONSchemaBench schemas (real ones users send; xgrammar compiles them):
# a required enum, a required 10-character string through a $ref with any
# other property allowed, an array of 1-character strings (the last two let
# the tiny model write long answers: the long streams of the partition step)
SCHEMA_FILES = ("Github_trivial/o43979.json", "Github_trivial/o41662.json",
                "Github_easy/o21730.json")


def _schemas() -> dict[str, dict]:
    from vllm_patch.testing import jsonschemabench

    out = {}
    for name in SCHEMA_FILES:
        path = jsonschemabench.SCHEMAS / name
        if not path.exists():
            pytest.skip(jsonschemabench.MISSING)
        out[name] = json.loads(path.read_text())
    return out


def _requests(n: int, offset: int = 0, max_tokens: int = wl.MAX_TOKENS) -> list[dict]:
    """n structured requests: the JSONSchemaBench schemas, regex and choice,
    completions and chat, streaming and not, in a fixed order; a unique
    prompt of >= 2 KV blocks each (so every prompt's KV travels P -> D)."""
    schemas = _schemas()
    kinds = [("schema", s) for s in schemas] + [("regex", None), ("choice", None)]
    mix = [dict(kind=k, schema=sch, chat=chat, stream=stream)
           for stream in (True, False) for k, sch in kinds
           for chat in ((False, True) if k != "regex" else (False,))]
    return [dict(mix[(offset + j) % len(mix)], i=1000 + offset + j, max_tokens=max_tokens)
            for j in range(n)]


# A regex whose every answer is long (120-160 letters, about as many tokens
# for the tiny model, which closes the real schemas above in a few tokens):
# the streams that are still running when the partition starts.
LONG_REGEX = r"[a-z]{120,160}"
# `stop` answers valid for their schema but with raw control characters in
# a length-bounded string (xgrammar 0.2.8's fault: see _valid)
CONTROL_CHARS: list[str] = []


def _valid(r: dict, text: str) -> bool:
    if r["kind"] == "long_regex":
        import re

        return re.fullmatch(LONG_REGEX, text) is not None
    if r["kind"] != "schema":
        return wl.valid(r["kind"], text)
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        # xgrammar 0.2.8 (vLLM 0.32/0.33's pin, stock alike) lets raw
        # control characters into a length-bounded string (maxLength /
        # minLength), which strict JSON refuses: the backend's known fault,
        # docs/structured-outputs.md. Only that one is let through, and
        # only when the answer is then valid for its schema; counted in
        # CONTROL_CHARS so the run's report shows it.
        if not e.msg.startswith("Invalid control character"):
            return False
        try:
            value = json.loads(text, strict=False)
        except ValueError:
            return False
        lenient = True
    else:
        lenient = False
    try:
        jsonschema.validate(value, _schemas()[r["schema"]])
    except jsonschema.ValidationError:
        return False
    if lenient:
        CONTROL_CHARS.append(text)
    return True


def _send(client, r: dict, seen: dict | None = None) -> dict:
    """One request through the openai client: its text and finish reason,
    or the clean error it ended with; its start, first chunk and end times
    (`time.monotonic()`), also in `seen[r["i"]]` while it runs."""
    import openai

    times = {"start": time.monotonic(), "first": None, "end": None}
    if seen is not None:
        seen[r["i"]] = times
    so = {"regex": wl.REGEX} if r["kind"] == "regex" else \
        {"regex": LONG_REGEX} if r["kind"] == "long_regex" else \
        {"choice": wl.CHOICES} if r["kind"] == "choice" else None
    kw = dict(model="tiny", max_tokens=r["max_tokens"], temperature=0, stream=r["stream"],
              extra_body={"structured_outputs": so} if so else {})
    text, finish, error = "", None, None
    try:
        if r["chat"]:
            if r["kind"] == "schema":
                kw["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "schema", "schema": _schemas()[r["schema"]]}}
            out = client.chat.completions.create(
                messages=[{"role": "user", "content": wl.prompt(r["i"])}], **kw)
        else:
            if r["kind"] == "schema":
                kw["extra_body"] = {"structured_outputs": {"json": _schemas()[r["schema"]]}}
            out = client.completions.create(prompt=wl.prompt(r["i"]), **kw)
        if r["stream"]:
            for ev in out:
                times["first"] = times["first"] or time.monotonic()
                for ch in ev.choices:
                    text += (ch.delta.content if r["chat"] else ch.text) or ""
                    finish = ch.finish_reason or finish
        else:
            ch = out.choices[0]
            text, finish = (ch.message.content if r["chat"] else ch.text) or "", ch.finish_reason
    except openai.APIError as e:
        error = f"{type(e).__name__}: {str(e)[:200]}"
    times["end"] = time.monotonic()
    return dict(text=text, finish=finish, error=error, s=times["end"] - times["start"],
                **times)


def _batch(client, reqs, during=None) -> list[dict]:
    """The requests at once (8 at a time); `during(seen)`, if given, runs
    meanwhile with the running requests' times (see _send)."""
    seen: dict = {}
    with cf.ThreadPoolExecutor(8) as ex:
        futs = [ex.submit(_send, client, r, seen) for r in reqs]
        if during:
            during(seen)
        return [f.result(timeout=REQUEST_BOUND_S + 30) for f in futs]


def _check_stop_valid(reqs, outs) -> None:
    bad = [(r, o) for r, o in zip(reqs, outs)
           if o["finish"] == "stop" and not _valid(r, o["text"])]
    assert bad == [], bad


def _idle(instances, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        state = {}
        for inst in instances:
            with urllib.request.urlopen(inst["url"] + "/metrics", timeout=10) as r:
                m = parse_metrics(r.read().decode())
            state[inst["name"]] = {k: m.get(k) for k in (
                "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                "vllm:num_requests_waiting")}
        if all(v == 0 for s in state.values() for v in s.values()) \
                or time.monotonic() > deadline:
            return state
        time.sleep(1)


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def _servers_on(c, node: str) -> list[int]:
    out = []
    for pid in c.nodes[node].pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"vllm.entrypoints" in cmd or b"EngineCore" in cmd or b"VLLM" in cmd:
            out.append(pid)
    return out


PARTITION_S = 20


def _long_requests(offset: int) -> list[dict]:
    """8 requests, max_tokens 256: 4 streams with long answers (LONG_REGEX),
    2 streams and 2 non-streaming requests with the real schemas."""
    mix = _requests(18, offset=offset, max_tokens=256)
    schema = [r for r in mix if r["kind"] == "schema"]
    long = [dict(schema[0], kind="long_regex", schema=None, chat=False, stream=True,
                 i=2000 + offset + j) for j in range(4)]
    return (long + [r for r in schema if r["stream"]][:2]
            + [r for r in schema if not r["stream"]][:2])


def _partition_decode(c, client, url: str, seconds: float) -> dict:
    """The decode node's link down for `seconds` while long requests run,
    from the moment the first stream has sent its first chunk; the router's
    /health probed every 2 s meanwhile. Every request must end within the
    bound, with an answer or a clean OpenAI-format error, at least one
    stream must have been cut by the partition, every `stop` answer valid."""
    window = {}
    health = set()

    def cut(seen):
        deadline = time.monotonic() + 120
        while not any(t["first"] and not t["end"] for t in seen.values()):
            assert time.monotonic() < deadline, "no stream under way in 120 s"
            time.sleep(0.05)
        c.nodes["C"].link(False)
        window["down"] = time.monotonic()
        while time.monotonic() - window["down"] < seconds:
            health.add(_health(url))
            time.sleep(2)
        c.nodes["C"].link(True)
        window["up"] = time.monotonic()

    reqs = _long_requests(offset=12)
    t0 = time.monotonic()
    outs = _batch(client, reqs, during=cut)
    down, up = window["down"], window["up"]
    cut_streams = [o for r, o in zip(reqs, outs)
                   if r["stream"] and o["first"] and o["first"] < down < o["end"]]
    out = {"partition": {
        "seconds": seconds, "wall_s": round(time.monotonic() - t0, 1),
        "requests": len(reqs), "ok": sum(o["error"] is None for o in outs),
        "finish": sorted(str(o["finish"]) for o in outs if o["error"] is None),
        "errors": sorted({o["error"] for o in outs if o["error"]}),
        "in_flight_at_cut": sum(o["start"] < down < o["end"] for o in outs),
        "streams_cut": len(cut_streams),
        "streams_cut_ended_after_link_up": sum(o["end"] > up for o in cut_streams),
        "longest_answer_chars": max(len(o["text"]) for o in outs),
        "max_s": round(max(o["s"] for o in outs), 1),
        "router_health_during": sorted(health)}}
    # /health tells the truth throughout: an answer (never a client
    # timeout), and not 200 while the decode node is cut off
    assert sorted(health) == [503], out
    assert all(o["s"] < REQUEST_BOUND_S for o in outs), outs
    # an answer ends with its finish reason; anything else is a clean error
    assert all(o["finish"] in ("stop", "length") for o in outs if o["error"] is None), outs
    assert cut_streams, ("no stream was under way when the link went down", out)
    # ...and one of them outlasted the partition (paused, not just ended)
    assert any(o["end"] > up for o in cut_streams), out
    _check_stop_valid(reqs, outs)
    return out


@pytest.mark.patched_only
@pytest.mark.timeout(1500)
def test_example_connector_across_namespaces(cluster):
    _schemas()  # skips now, before the launch, when the sample is missing
    c = cluster
    # the folder every node sees (one file system: like an NFS mount), with
    # a file of the user's in it
    kv = c.root / "kv"
    kv.mkdir()
    (kv / "notes.txt").write_text("the user's")
    launcher, ready = _launch(c, ["--connector", "ExampleConnector",
                                  "--kv-connector-extra-config",
                                  json.dumps({"shared_storage_path": str(kv)})])
    own = [p for p in kv.iterdir() if p.name.startswith("vllm-patch-")]
    assert len(own) == 1 and own[0].is_dir(), own
    own = own[0]
    assert (f"KV cache files (ExampleConnector) in {own}, this deployment's own folder, "
            "removed when it stops") in (c.root / "launch.log").read_text()
    url = ready["url"]
    assert url == f"http://{c.nodes['A'].ip}:{ROUTER_PORT}", url
    by_name = {i["name"]: i for i in ready["instances"]}
    assert by_name["prefill-0"]["url"].startswith(f"http://{c.nodes['B'].ip}:")
    assert by_name["decode-0"]["url"].startswith(f"http://{c.nodes['C'].ip}:")
    client = _client(url)
    report = {}

    # 1. traffic: concurrent, streaming and not, schemas / regex / choice
    reqs = _requests(12)
    outs = _batch(client, reqs)
    assert [o["error"] for o in outs] == [None] * 12, outs
    _check_stop_valid(reqs, outs)
    report["baseline"] = {"ok": 12, "stop": sum(o["finish"] == "stop" for o in outs)}
    # prefill on B wrote the prompts' KV cache there, decode on C read it
    report["kv_files"] = len(list(own.glob("*/*.safetensors")))
    assert report["kv_files"] > 0, sorted(own.rglob("*"))
    assert wl.is_idle(_idle(ready["instances"]))

    # 2. the decode node's link down 20 s under load, then up: long streams
    # and the real schemas, the link cut once streams are under way
    report.update(_partition_decode(c, client, url, PARTITION_S))
    assert launcher.poll() is None, (c.root / "launch.log").read_text()[-3000:]
    deadline = time.monotonic() + 120
    while _health(url) != 200:
        assert time.monotonic() < deadline, "router /health not 200 after the partition"
        time.sleep(2)
    reqs = _requests(6, offset=20)
    outs = _batch(client, reqs)
    assert [o["error"] for o in outs] == [None] * 6, outs
    _check_stop_valid(reqs, outs)
    idle = _idle(ready["instances"])
    report["after_partition"] = {"ok": 6, "idle": idle}
    assert wl.is_idle(idle), idle

    # 3. clean stop: SIGINT to the launcher
    launcher.send_signal(signal.SIGINT)
    code = launcher.wait(timeout=180)
    report["stop"] = {"exit": code}
    print("\nMULTINODE " + json.dumps(report))
    assert code == 0, (c.root / "launch.log").read_text()[-3000:]
    for n in "ABC":
        assert _servers_on(c, n) == [], n
    assert list((c.root / "tmp").glob("vllm-patch-launch-*")) == []
    # the deployment's KV folder is gone on every node, the user's file stays
    assert sorted(p.name for p in kv.iterdir()) == ["notes.txt"]
    assert (kv / "notes.txt").read_text() == "the user's"
    assert len([n for n in c.ray_nodes() if n["alive"]]) == 3  # the cluster stays


STANDIN = "{python} -m vllm_patch.testing.standin_server"


@pytest.mark.patched_only
@pytest.mark.timeout(600)
def test_kv_folder_local_to_each_node_is_made_and_removed_on_each(cluster_local_kv):
    """ExampleConnector's shared_storage_path at the same path on every node
    but not shared (a local disk each): the supervisor on B and the one on C
    each make the deployment's subfolder in their own folder, and at SIGINT
    each removes its own; the user's file on each node stays, and nothing is
    made on A (no instance there). Stand-in servers (no model: this is
    about the launcher's folders); the test drops a file in each subfolder
    where a server's KV files would be."""
    c = cluster_local_kv
    shared = c.local_folder(None)
    folders = {"A": shared, "B": c.local_folder("B"), "C": c.local_folder("C")}
    for n, f in folders.items():
        (f / f"notes-{n}.txt").write_text(f"the user's, on {n}")
    ready = c.root / "ready.json"
    p = c.spawn("A", ["vllm-patch", "launch", "--address", c.address, "--model", "standin",
                      "--server-command", STANDIN, "--connector", "ExampleConnector",
                      "--kv-connector-extra-config",
                      json.dumps({"shared_storage_path": str(shared)}),
                      "--prefill-resource", "prefill", "--decode-resource", "decode",
                      "--host", c.nodes["A"].ip, "--port", str(ROUTER_PORT),
                      "--ready-file", str(ready), "--", "--kv-cache-memory-bytes", "1"],
                "launch-local.log")
    log = c.root / "launch-local.log"
    deadline = time.monotonic() + 180
    while not ready.exists():
        assert p.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(1)
    info = json.loads(ready.read_text())
    own = [f for f in folders["B"].iterdir() if f.name.startswith("vllm-patch-")]
    assert len(own) == 1, own
    name = own[0].name
    assert f"KV cache files (ExampleConnector) in {shared / name}, this deployment's " \
        "own folder, removed when it stops" in log.read_text()
    assert (folders["C"] / name).is_dir()
    assert not (folders["A"] / name).exists()  # no instance on A
    req = urllib.request.Request(info["url"] + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": "x", "max_tokens": 4}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
    for n in "BC":
        (folders[n] / name / "5f3a").mkdir()
        (folders[n] / name / "5f3a" / "layer.0.safetensors").write_bytes(b"kv")
    p.send_signal(signal.SIGINT)
    code = p.wait(timeout=120)
    text = log.read_text()
    assert code == 0, text[-3000:]
    for n, f in folders.items():
        assert sorted(x.name for x in f.iterdir()) == [f"notes-{n}.txt"], (n, text[-3000:])
        assert (f / f"notes-{n}.txt").read_text() == f"the user's, on {n}"
    assert "may remain" not in text and "could not remove" not in text, text[-3000:]
    for n in "BC":
        assert _servers_on(c, n) == [], n
