"""Faults across the network namespaces, with real vLLM servers and the
official `openai` client under concurrent streaming and non-streaming load
of real structured requests (JSONSchemaBench schemas, regex, choice):

- a vLLM server killed on its node (SIGKILL to the decode server on C while
  long streams run, then to the prefill server on B): every request ends
  within the bound (an answer, or a clean OpenAI-format error / error
  event), the launcher restarts the server on its node, the router's
  /health answers 503 while it is down and 200 once it is back, new
  requests are served, 0 KV blocks held at idle on every instance, every
  `stop` answer valid for its schema.

    python -m pytest tests/multinode/test_multinode_faults.py -m multinode -x -s
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from vllm_patch.testing import workload as wl

from .test_multinode import (CONTROL_CHARS, REQUEST_BOUND_S, _batch, _check_stop_valid, _client, _health,
                             _idle, _launch, _long_requests, _requests, _schemas,
                             _servers_on)

RECOVERY_S = 300


def _kill_under_load(c, client, url: str, pid: int, offset: int) -> dict:
    """SIGKILL `pid` (a vLLM server) once a stream is under way; the
    router's /health probed every second from the kill until it answers
    200 again. Returns what happened; asserts the outcomes."""
    window: dict = {}
    health: list[tuple[float, int]] = []

    def kill(seen):
        deadline = time.monotonic() + 120
        while not any(t["first"] and not t["end"] for t in seen.values()):
            assert time.monotonic() < deadline, "no stream under way in 120 s"
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        window["kill"] = time.monotonic()

    reqs = _long_requests(offset=offset)
    outs = _batch(client, reqs, during=kill)
    killed = window["kill"]
    # /health until it is 200 again (the launcher restarts the server)
    while True:
        code = _health(url)
        health.append((round(time.monotonic() - killed, 1), code))
        if code == 200:
            break
        assert time.monotonic() - killed < RECOVERY_S, ("not healthy again", health[-5:])
        time.sleep(1)
    cut = [o for r, o in zip(reqs, outs) if o["start"] < killed < o["end"]]
    out = {
        "requests": len(reqs), "ok": sum(o["error"] is None for o in outs),
        "finish": sorted(str(o["finish"]) for o in outs if o["error"] is None),
        "errors": sorted({o["error"][:120] for o in outs if o["error"]}),
        "in_flight_at_kill": len(cut),
        "max_s": round(max(o["s"] for o in outs), 1),
        "health_codes_until_back": sorted({h for _, h in health}),
        "healthy_again_s": health[-1][0]}
    # no client hangs: every request ended within the bound...
    assert all(o["s"] < REQUEST_BOUND_S for o in outs), outs
    # ...with an answer that has its finish reason, or a clean error
    assert all(o["finish"] in ("stop", "length") for o in outs if o["error"] is None), outs
    assert all(o["error"].startswith(("APIError", "InternalServerError",
                                      "APIStatusError", "BadGateway"))
               for o in outs if o["error"]), outs
    assert cut, ("no request in flight at the kill", out)
    # /health told the truth: never no answer, 503 while down, 200 after
    assert 0 not in out["health_codes_until_back"], health
    assert health[0][1] == 503 or len(health) == 1, health
    assert set(out["health_codes_until_back"]) <= {200, 503}, health
    _check_stop_valid(reqs, outs)
    return out


def _server_pid(c, node: str) -> int:
    """The vLLM API server's pid on a node (the process the supervisor
    started: its own session leader)."""
    for pid in _servers_on(c, node):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in cmd and os.getsid(pid) == pid:
            return pid
    raise AssertionError(f"no vLLM API server on node {node}")


def _served_per(client, by_name, names, reqs) -> dict:
    """Send `reqs` at once; every one must be answered (and each `stop`
    answer valid); return how many requests each server in `names` (all of
    one role) served."""
    before = {n: _successes(by_name[n]) for n in names}
    outs = _batch(client, reqs)
    assert [o["error"] for o in outs] == [None] * len(reqs), outs
    _check_stop_valid(reqs, outs)
    return {n: _successes(by_name[n]) - before[n] for n in names}


def _launch_example(c, *extra: str):
    """The launcher across the nodes with ExampleConnector over the
    cluster's shared folder (a fresh `kv` folder in it)."""
    kv = c.root / "kv"
    kv.mkdir()
    return _launch(c, ["--connector", "ExampleConnector",
                       "--kv-connector-extra-config",
                       json.dumps({"shared_storage_path": str(kv)}), *extra])


@pytest.mark.patched_only
@pytest.mark.timeout(1800)
def test_a_server_killed_on_its_node_under_load(cluster):
    _schemas()  # skips now, before the launch, when the sample is missing
    c = cluster
    launcher, ready = _launch_example(c)
    url = ready["url"]
    client = _client(url)
    log = c.root / "launch.log"
    report: dict = {}
    for step, (node, name) in enumerate((("C", "decode-0"), ("B", "prefill-0"))):
        pid = _server_pid(c, node)
        report[f"kill_{name}"] = _kill_under_load(c, client, url, pid, offset=40 + 20 * step)
        assert launcher.poll() is None, log.read_text()[-3000:]
        text = log.read_text()
        assert f"{name} exited (code -9: killed by SIGKILL); restarted (1/2)" in text, \
            text[-3000:]
        assert _server_pid(c, node) != pid
        # served again: new requests all answered, valid, nothing held
        reqs = _requests(6, offset=60 + 20 * step)
        outs = _batch(client, reqs)
        assert [o["error"] for o in outs] == [None] * 6, outs
        _check_stop_valid(reqs, outs)
        idle = _idle(ready["instances"])
        report[f"kill_{name}"]["after"] = {"ok": 6, "idle": idle}
        print(f"\nMULTINODE-FAULT {name} " + json.dumps(report[f"kill_{name}"]))
        assert wl.is_idle(idle), idle

    launcher.send_signal(signal.SIGINT)
    code = launcher.wait(timeout=180)
    report["stop"] = {"exit": code}
    report["stop_answers_with_raw_control_characters"] = len(CONTROL_CHARS)
    print("\nMULTINODE-FAULT " + json.dumps(report))
    assert code == 0, log.read_text()[-3000:]
    for n in "ABC":
        assert _servers_on(c, n) == [], n
    assert list((c.root / "tmp").glob("vllm-patch-launch-*")) == []


def _successes(inst: dict) -> float:
    """Requests a server finished (a prefill server finishes each at its
    one token)."""
    import urllib.request

    from vllm_patch.launch.router import parse_metrics

    with urllib.request.urlopen(inst["url"] + "/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode()).get("vllm:request_success_total", 0.0)


def _wait_log(log, text: str, timeout_s: float, launcher) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert launcher.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, (text, log.read_text()[-3000:])
        time.sleep(1)


SCALED_PORT = 18300


@pytest.mark.patched_only
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("scaled", ["decode", "prefill"], ids=["1p2d", "2p1d"])
def test_scale_out_and_a_node_lost_and_back(scaled, request):
    """Two instances of the `scaled` role on nodes B/C and D, one of the
    other role (1 prefill + 2 decode, then 2 prefill + 1 decode): the router
    balances over the two and /metrics shows every instance. Then node D is
    gone under load (its Ray worker and servers killed): requests in flight
    on D end with a clean error, every request started after it is served
    by the other instance of the role, the launcher keeps the deployment up
    and says so, /health answers 503 (an instance down). D's Ray worker
    started again: the lost instance is started there and rejoins; /health
    200, both instances of the role serve, 0 KV blocks held at idle, clean
    stop."""
    import urllib.request

    _schemas()
    c = request.getfixturevalue("cluster_1p2d" if scaled == "decode" else "cluster_2p1d")
    single = "prefill" if scaled == "decode" else "decode"
    launcher, ready = _launch_example(c, f"--{scaled}", "2",
                                      f"--{scaled}-port", str(SCALED_PORT))
    log = c.root / "launch.log"
    url = ready["url"]
    client = _client(url)
    by_name = {i["name"]: i for i in ready["instances"]}
    ips = {n: c.nodes[n].ip for n in "BCD"}
    on = {name: next(n for n, ip in ips.items() if i["url"].startswith(f"http://{ip}:"))
          for name, i in by_name.items()}
    pair = (f"{scaled}-0", f"{scaled}-1")
    assert on[f"{single}-0"] == c.node_of(single)[0] and \
        {on[n] for n in pair} == {*c.node_of(scaled)}, on
    d_name = next(n for n in pair if on[n] == "D")
    s_name = next(n for n in pair if on[n] != "D")
    report: dict = {"placement": on}

    # 1. balanced, /metrics shows every instance
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    for role, idx in ((single, 0), (scaled, 0), (scaled, 1)):
        assert f'pd_role="{role}",pd_index="{idx}"' in text, (role, idx)
    served = _served_per(client, by_name, (s_name, d_name), _requests(12))
    report["balanced"] = served
    assert all(v >= 4 for v in served.values()), served

    # 2. node D gone under load
    window: dict = {}
    health: set = set()

    def kill_d(seen):
        deadline = time.monotonic() + 120
        while not any(t["first"] and not t["end"] for t in seen.values()):
            assert time.monotonic() < deadline, "no stream under way in 120 s"
            time.sleep(0.05)
        c.stop_node("D")
        window["gone"] = time.monotonic()

    reqs = _long_requests(offset=70)
    outs = _batch(client, reqs, during=kill_d)
    assert all(o["s"] < REQUEST_BOUND_S for o in outs), outs
    assert all(o["finish"] in ("stop", "length") for o in outs if o["error"] is None), outs
    assert all(o["error"].startswith(("APIError", "InternalServerError"))
               for o in outs if o["error"]), outs
    _check_stop_valid(reqs, outs)
    report["node_gone"] = {
        "requests": len(reqs), "ok": sum(o["error"] is None for o in outs),
        "errors": sorted({o["error"][:120] for o in outs if o["error"]}),
        "max_s": round(max(o["s"] for o in outs), 1)}
    # started after the fault: all served, by the survivor
    s0 = _successes(by_name[s_name])
    reqs = _requests(6, offset=90)
    t0 = time.monotonic()
    outs = _batch(client, reqs)
    health.add(_health(url))
    assert [o["error"] for o in outs] == [None] * 6, outs
    _check_stop_valid(reqs, outs)
    assert _successes(by_name[s_name]) - s0 == 6
    report["after_gone"] = {"ok": 6, "wall_s": round(time.monotonic() - t0, 1)}
    _wait_log(log, f"{d_name} on node {ips['D']} lost", 180, launcher)
    assert f"The deployment keeps serving: {scaled} requests go to {s_name}" \
        in log.read_text()
    report["lost_logged_s_after"] = round(time.monotonic() - window["gone"], 1)
    health.add(_health(url))
    report["health_while_gone"] = sorted(health)
    assert health == {503}, health

    # 3. D back: its instance started there again and rejoins
    back = time.monotonic()
    c.start_worker("D")
    _wait_log(log, f"{d_name} rejoined", 400, launcher)
    report["rejoined_s"] = round(time.monotonic() - back, 1)
    assert f"{d_name} started again on node {ips['D']}" in log.read_text()
    assert _health(url) == 200
    served = _served_per(client, by_name, (s_name, d_name), _requests(6, offset=100))
    report["after_rejoin"] = served
    assert all(v >= 2 for v in served.values()), served
    idle = _idle(ready["instances"])
    report["idle"] = idle
    report["stop_answers_with_raw_control_characters"] = len(CONTROL_CHARS)
    print(f"\nMULTINODE-NODE-LOST-{scaled.upper()} " + json.dumps(report))
    assert wl.is_idle(idle), idle

    launcher.send_signal(signal.SIGINT)
    code = launcher.wait(timeout=180)
    assert code == 0, log.read_text()[-3000:]
    for n in "ABCD":
        assert _servers_on(c, n) == [], n
    assert list((c.root / "tmp").glob("vllm-patch-launch-*")) == []
    assert len([n for n in c.ray_nodes() if n["alive"]]) == 4


PREFILL_PARTITION_S = 30


@pytest.mark.patched_only
@pytest.mark.timeout(1800)
def test_the_prefill_nodes_link_down_under_load(cluster):
    """The prefill node's (B) link down for 30 s while long streams decode
    on C and 4 more requests arrive during the partition (their prefill
    cannot reach B): every request ends within the bound with an answer
    or a clean error, the router's /health answers 503 at every probe
    while B is cut off. Ray declares a node dead after about 30 s without
    its health checks (its defaults), and B's Ray worker then exits once
    the link is back, ending B's supervisor: then the launcher keeps the
    deployment (B's was the only prefill instance: requests get a clean
    503 meanwhile), nothing of the server is left on B (its engine core
    included: the guard), and once B's Ray worker is started again (what a
    service manager does) the instance is started there and rejoins. If
    Ray keeps B, the instance just goes on serving. Either way: later
    requests are served, 0 KV blocks held at idle, every `stop` answer
    valid, and a clean stop leaves nothing on any node."""
    import concurrent.futures as cf

    from .test_multinode import _send

    _schemas()
    c = cluster
    # a fixed port: an instance started again keeps its address
    launcher, ready = _launch_example(c, "--prefill-port", str(SCALED_PORT))
    log = c.root / "launch.log"
    url = ready["url"]
    client = _client(url)
    b_ip = c.nodes["B"].ip
    window: dict = {}
    health: set = set()
    late_reqs = _requests(4, offset=120)
    late: list = []

    def cut(seen):
        deadline = time.monotonic() + 120
        while not any(t["first"] and not t["end"] for t in seen.values()):
            assert time.monotonic() < deadline, "no stream under way in 120 s"
            time.sleep(0.05)
        c.nodes["B"].link(False)
        window["down"] = time.monotonic()
        with cf.ThreadPoolExecutor(4) as ex:
            futs = [ex.submit(_send, client, r) for r in late_reqs]
            while time.monotonic() - window["down"] < PREFILL_PARTITION_S:
                health.add(_health(url))
                time.sleep(2)
            c.nodes["B"].link(True)
            window["up"] = time.monotonic()
            late.extend(f.result(timeout=REQUEST_BOUND_S + 30) for f in futs)

    reqs = _long_requests(offset=110)
    t0 = time.monotonic()
    outs = _batch(client, reqs, during=cut)
    all_reqs, all_outs = reqs + late_reqs, outs + late
    report: dict = {"prefill_partition": {
        "seconds": PREFILL_PARTITION_S, "wall_s": round(time.monotonic() - t0, 1),
        "requests": len(all_reqs), "ok": sum(o["error"] is None for o in all_outs),
        "started_during_partition_ok": sum(o["error"] is None for o in late),
        "finish": sorted(str(o["finish"]) for o in all_outs if o["error"] is None),
        "errors": sorted({o["error"][:120] for o in all_outs if o["error"]}),
        "max_s": round(max(o["s"] for o in all_outs), 1),
        "router_health_during": sorted(health)}}
    print("\nMULTINODE-PREFILL-PARTITION " + json.dumps(report))
    assert all(o["s"] < REQUEST_BOUND_S for o in all_outs), all_outs
    assert all(o["finish"] in ("stop", "length") for o in all_outs
               if o["error"] is None), all_outs
    assert all(o["error"].startswith(("APIError", "InternalServerError"))
               for o in all_outs if o["error"]), all_outs
    _check_stop_valid(all_reqs, all_outs)
    assert health == {503}, health
    assert launcher.poll() is None, log.read_text()[-3000:]

    # Did Ray declare B dead? (its worker exits and the supervisor with it)
    lost_line = f"prefill-0 on node {b_ip} lost"
    deadline = time.monotonic() + 120
    while lost_line not in log.read_text() and time.monotonic() < deadline:
        assert launcher.poll() is None, log.read_text()[-3000:]
        time.sleep(2)
    after: dict = {"ray_declared_b_dead": lost_line in log.read_text()}
    if after["ray_declared_b_dead"]:
        after["lost_logged_s_after_link_up"] = round(time.monotonic() - window["up"], 1)
        assert "No prefill instance serves now: requests get a 503" in log.read_text()
        # a request meanwhile: a clean 503 at once, no hang
        out = _send(client, _requests(1, offset=140)[0])
        assert out["error"] and out["error"].startswith("InternalServerError") \
            and "no prefill instance is serving" in out["error"] and out["s"] < 5, out
        assert _health(url) == 503
        # nothing of the server left on B (before the guard: its engine core)
        deadline = time.monotonic() + 60
        while _servers_on(c, "B"):
            assert time.monotonic() < deadline, (
                "vLLM processes left on B after its supervisor ended",
                [open(f"/proc/{p}/cmdline", "rb").read()[:120] for p in _servers_on(c, "B")
                 if os.path.exists(f"/proc/{p}")])
            time.sleep(1)
        # B's Ray worker started again, as a service manager would
        c.stop_node("B")  # what is left of its Ray processes, if anything
        back = time.monotonic()
        c.start_worker("B")
        _wait_log(log, "prefill-0 rejoined", 400, launcher)
        after["rejoined_s_after_worker_start"] = round(time.monotonic() - back, 1)
        assert f"prefill-0 started again on node {b_ip}" in log.read_text()
        assert "prefill serves again after" in log.read_text()
    deadline = time.monotonic() + 120
    while _health(url) != 200:
        assert time.monotonic() < deadline, "router /health not 200 after the partition"
        time.sleep(2)
    reqs = _requests(6, offset=130)
    outs = _batch(client, reqs)
    assert [o["error"] for o in outs] == [None] * 6, outs
    _check_stop_valid(reqs, outs)
    idle = _idle(ready["instances"])
    after.update(ok=6, idle=idle)
    report["after"] = after
    report["stop_answers_with_raw_control_characters"] = len(CONTROL_CHARS)
    print("\nMULTINODE-PREFILL-PARTITION " + json.dumps(report))
    assert wl.is_idle(idle), idle
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=180) == 0, log.read_text()[-3000:]
    for n in "ABC":
        left = _servers_on(c, n)
        assert left == [], (n, [open(f"/proc/{p}/cmdline", "rb").read()[:200]
                                for p in left if os.path.exists(f"/proc/{p}")],
                            log.read_text()[-3000:])
    assert list((c.root / "tmp").glob("vllm-patch-launch-*")) == []
