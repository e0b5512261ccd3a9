"""`vllm-patch launch` with NixlConnector across the network namespaces:
prefill on node B, decode on node C, the KV cache read by C from B over
UCX's TCP transport between the nodes' own addresses (the launcher sets each
server's NIXL side-channel host to its node's address). The official
`openai` client sends concurrent structured requests (JSONSchemaBench
schemas, regex, choice; streaming and not); the decode server's NIXL
metrics must show the KV read from B, not recomputed. Then the decode
node's link goes down while requests have prefilled on B: B's KV blocks
for them must return to free within the KV lease (`kv_lease_duration`, set
short here with --kv-connector-extra-config). Then the decode server is
SIGKILLed on C under load: requests in flight end with a clean error, its
supervisor starts it again, the blocks B held for requests C never read
are freed within the lease, later requests are served and 0 KV blocks are
held at idle. Needs `nixl` importable.

    python -m pytest tests/multinode/test_multinode_nixl.py -m multinode -x -s
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request

import pytest
import yaml

from vllm_patch.launch.router import parse_metrics
from vllm_patch.testing import workload as wl

from .test_multinode import (_batch, _check_stop_valid, _client, _health, _idle, _launch,
                             _requests, _schemas, _servers_on)

# short, so the lease step takes seconds (the launcher's default is 120 s)
LEASE_S = 20


def _metrics(inst: dict) -> dict[str, float]:
    with urllib.request.urlopen(inst["url"] + "/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode())


def _tcp_peers(c, node: str, peer_ip: str) -> list[tuple[str, str]]:
    """Established TCP connections of `node` with `peer_ip`: (local, remote)."""
    out = subprocess.run(c.nodes[node].cmd("ss", "-Htn", "state", "established"),
                         capture_output=True, text=True, timeout=30).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[-1].rsplit(":", 1)[0] == peer_ip:
            rows.append((parts[-2], parts[-1]))
    return rows


def _side_channel_port(c, node: str) -> str | None:
    for pid in _servers_on(c, node):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(b"VLLM_NIXL_SIDE_CHANNEL_PORT="):
                return kv.split(b"=", 1)[1].decode()
    return None


@pytest.mark.patched_only
@pytest.mark.nixl
@pytest.mark.timeout(1500)
def test_nixl_connector_across_namespaces(cluster):
    pytest.importorskip("nixl._api", reason="nixl not installed")
    _schemas()  # skips now, before the launch, when the sample is missing
    c = cluster
    # The namespaces share this host: UCX would pick its shared-memory
    # transports between them (one machine to UCX), so the KV would never
    # touch the network. UCX_TLS=tcp makes them talk as separate hosts do
    # without RDMA. The two "nodes" also share this host's cores: each
    # server gets its own (cpu_bind), as on two hosts.
    cfg = c.root / "pd.yaml"
    cfg.write_text(yaml.safe_dump({
        "env": {"UCX_TLS": "tcp"},
        "prefill": {"cpu_bind": "0"}, "decode": {"cpu_bind": "1"}}))
    launcher, ready = _launch(c, ["--config", str(cfg), "--connector", "NixlConnector",
                                  "--kv-connector-extra-config",
                                  json.dumps({"kv_lease_duration": LEASE_S})])
    log = (c.root / "launch.log").read_text()
    assert (f"NIXL KV lease: a prefill server frees a prompt's KV blocks {LEASE_S} s "
            "after its prefill") in log, log[-3000:]
    url = ready["url"]
    by_name = {i["name"]: i for i in ready["instances"]}
    pre, dec = by_name["prefill-0"], by_name["decode-0"]
    assert pre["url"].startswith(f"http://{c.nodes['B'].ip}:"), pre
    assert dec["url"].startswith(f"http://{c.nodes['C'].ip}:"), dec
    client = _client(url)
    report: dict = {}

    # 1. traffic: concurrent, streaming and not, real schemas / regex / choice
    d0, p0 = _metrics(dec), _metrics(pre)
    reqs = _requests(12)
    t0 = time.monotonic()
    outs = _batch(client, reqs)
    wall = time.monotonic() - t0
    assert [o["error"] for o in outs] == [None] * 12, outs
    _check_stop_valid(reqs, outs)
    d1, p1 = _metrics(dec), _metrics(pre)
    delta = lambda m1, m0, k: m1.get(k, 0.0) - m0.get(k, 0.0)  # noqa: E731
    report["baseline"] = {
        "requests": 12, "wall_s": round(wall, 1),
        "stop": sum(o["finish"] == "stop" for o in outs),
        "decode_nixl_transfers": delta(d1, d0, "vllm:nixl_xfer_time_seconds_count"),
        "decode_nixl_bytes": delta(d1, d0, "vllm:nixl_bytes_transferred_sum"),
        "decode_nixl_failed": delta(d1, d0, "vllm:nixl_num_failed_transfers_total"),
        "decode_external_prefix_hit_tokens":
            delta(d1, d0, "vllm:external_prefix_cache_hits_total"),
        "decode_prompt_tokens": delta(d1, d0, "vllm:prompt_tokens_total"),
        "prefill_expired": delta(p1, p0, "vllm:nixl_num_kv_expired_reqs_total")}
    b = report["baseline"]
    # the KV was read from B over NIXL for every request, not recomputed
    assert b["decode_nixl_transfers"] >= 12, report
    assert b["decode_nixl_bytes"] > 0 and b["decode_nixl_failed"] == 0, report
    assert b["decode_external_prefix_hit_tokens"] > 0, report
    assert b["prefill_expired"] == 0, report
    # ...over TCP between B's and C's addresses, besides the side channel
    side = _side_channel_port(c, "B")
    peers = _tcp_peers(c, "C", c.nodes["B"].ip)
    report["c_to_b_tcp"] = sorted({r for _, r in peers})
    assert any(r.rsplit(":", 1)[1] != side for _, r in peers), (side, peers)
    idle = _idle(ready["instances"])
    report["idle"] = idle
    assert wl.is_idle(idle), idle

    # 2. the KV lease: the decode node cut off while 4 requests prefill on
    # B; B holds their blocks for C, which never reads them (no heartbeat
    # reaches B either), until the lease ends
    p0 = _metrics(pre)
    c.nodes["C"].link(False)
    down = time.monotonic()
    reqs = _requests(4, offset=30)
    held, freed_at, health = 0.0, None, set()

    def watch(seen):
        nonlocal held, freed_at
        while time.monotonic() - down < LEASE_S + 30:
            m = _metrics(pre)
            usage = m.get("vllm:kv_cache_usage_perc", 0.0)
            held = max(held, usage)
            expired = m.get("vllm:nixl_num_kv_expired_reqs_total", 0.0) - \
                p0.get("vllm:nixl_num_kv_expired_reqs_total", 0.0)
            health.add(_health(url))
            if held > 0 and usage == 0 and expired >= len(reqs) and freed_at is None:
                freed_at = time.monotonic()
                break
            time.sleep(0.5)
        c.nodes["C"].link(True)

    outs = _batch(client, reqs, during=watch)
    up = time.monotonic()
    p1 = _metrics(pre)
    report["lease"] = {
        "kv_lease_duration": LEASE_S, "prefill_usage_held_max": held,
        "freed_s_after_cut": None if freed_at is None else round(freed_at - down, 1),
        "link_down_s": round(up - down, 1),
        "expired": delta(p1, p0, "vllm:nixl_num_kv_expired_reqs_total"),
        "notifications_after_expiry":
            delta(p1, p0, "vllm:nixl_num_notifications_after_expiry_total"),
        "ok": sum(o["error"] is None for o in outs),
        "errors": sorted({o["error"] for o in outs if o["error"]}),
        "max_s": round(max(o["s"] for o in outs), 1),
        "router_health_during": sorted(health)}
    lease = report["lease"]
    print("\nMULTINODE-NIXL " + json.dumps(report))
    assert held > 0, report             # B did hold the blocks for C
    assert freed_at is not None, report  # and freed them within the lease (+ slack)
    assert freed_at - down < LEASE_S + 30, report
    assert lease["expired"] >= len(reqs), report
    assert 503 in health, report
    assert all(o["s"] < 240 for o in outs), outs
    assert all(o["finish"] in ("stop", "length") for o in outs if o["error"] is None), outs
    _check_stop_valid(reqs, outs)
    assert launcher.poll() is None, (c.root / "launch.log").read_text()[-3000:]

    # 3. after the link is back: served again, 0 KV blocks held at idle
    deadline = time.monotonic() + 120
    while _health(url) != 200:
        assert time.monotonic() < deadline, "router /health not 200 after the partition"
        time.sleep(2)
    reqs = _requests(6, offset=40)
    outs = _batch(client, reqs)
    assert [o["error"] for o in outs] == [None] * 6, outs
    _check_stop_valid(reqs, outs)
    idle = _idle(ready["instances"])
    report["after"] = {"ok": 6, "idle": idle}
    assert wl.is_idle(idle), idle

    # 4. the decode server SIGKILLed on C under load: requests in flight end
    # with a clean error, its supervisor starts it again, the blocks B held
    # for requests C never read are freed within the lease, later requests
    # are served, 0 KV blocks at idle
    from .test_multinode_faults import _kill_under_load, _server_pid

    p0 = _metrics(pre)
    killed = _kill_under_load(c, client, url, _server_pid(c, "C"), offset=50)
    reqs = _requests(6, offset=60)
    outs = _batch(client, reqs)
    assert [o["error"] for o in outs] == [None] * 6, outs
    _check_stop_valid(reqs, outs)
    idle = _idle(ready["instances"], timeout_s=LEASE_S + 60)
    killed.update(idle=idle, expired=delta(_metrics(pre), p0,
                                           "vllm:nixl_num_kv_expired_reqs_total"))
    report["decode_killed"] = killed
    assert wl.is_idle(idle), report

    # 5. clean stop
    launcher.send_signal(signal.SIGINT)
    code = launcher.wait(timeout=180)
    report["stop"] = {"exit": code}
    print("\nMULTINODE-NIXL " + json.dumps(report))
    assert code == 0, (c.root / "launch.log").read_text()[-3000:]
    for n in "ABC":
        assert _servers_on(c, n) == [], n
    assert list((c.root / "tmp").glob("vllm-patch-launch-*")) == []
