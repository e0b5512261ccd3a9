"""`vllm-patch launch` lifecycle on a real 3-node Ray cluster, with the
stand-in server (starts in < 1 s, keeps a child process like vLLM's engine
core): placement by node resource, routing, restart of a killed instance,
bounded restarts, teardown leaving no process, clear errors for bad config,
and the CLI under SIGINT."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

from vllm_patch.launch.config import LaunchConfig, LaunchError, load
from vllm_patch.launch.deployment import Deployment, cpu_bind_ranges

# The launcher does not depend on the patches: patched run only.
pytestmark = pytest.mark.patched_only

STANDIN = ["{python}", "-m", "vllm_patch.testing.standin_server"]


def config(**kw) -> LaunchConfig:
    # the stand-in needs no memory: its own setting keeps the launcher's
    # memory split (and its refusal on a busy host) out of these tests
    base = dict(model="standin", server_command=STANDIN,
                env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                prefill={"node_resource": "prefill_node"},
                decode={"node_resource": "decode_node"},
                router={"port": 0}, start_timeout_s=60)
    base.update(kw)
    return LaunchConfig.model_validate(base)


def server_pids(dep: Deployment) -> list[int]:
    """Every process of every instance's group (server + its child)."""
    pids = []
    for inst in dep.instances:
        pgid = inst.status["pid"]
        pids += [p.pid for p in psutil.process_iter() if _pgid(p.pid) == pgid]
    return pids


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def gone(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def ask(url: str) -> dict:
    r = requests.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 4},
                      timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait_ready(proc: subprocess.Popen, ready: Path, timeout_s: float) -> dict:
    """The launch's ready file, once written (the launcher still running)."""
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.5)
    return json.loads(ready.read_text())


def test_placement_routing_teardown(ray_cluster, node_of_resource):
    lines: list[str] = []
    with Deployment(config(decode={"node_resource": "decode_node", "count": 2}),
                    progress=lines.append) as dep:
        nodes = {i.name: i.info["node_id"] for i in dep.instances}
        assert nodes == {"prefill-0": node_of_resource["prefill_node"],
                         "decode-0": node_of_resource["decode_node"],
                         "decode-1": node_of_resource["decode_node"]}
        served = set()
        for _ in range(4):
            out = ask(dep.url)
            assert json.loads(out["choices"][0]["text"]) == {"city": "paris", "items": [1]}
            assert out["served_by"]["role"] == "decode"
            # the decode request carried the prefill instance's kv_transfer_params
            prefill_port = dep.role_instances("prefill")[0].status["port"]
            assert out["received_kv_transfer_params"] == {"remote_port": prefill_port,
                                                          "standin": True}
            served.add(out["served_by"]["port"])
        assert len(served) == 2  # both decode instances take requests
        pids = server_pids(dep)
        actor_pids = [i.info["actor_pid"] for i in dep.instances]
        assert len(pids) == 6  # 3 servers, each with its child
    assert gone(pids) == []
    assert gone(actor_pids, 30) == []  # the supervisor actors' processes too
    text = "\n".join(lines)
    assert "prefill-0 healthy" in text and "ready: router" in text and "stopped" in text


def test_placement_by_node_labels(ray_cluster, node_of_resource):
    cfg = config(prefill={"node_labels": {"pd-role": "prefill"}},
                 decode={"node_labels": {"pd-role": "decode"}, "count": 2})
    with Deployment(cfg) as dep:
        assert {i.name: i.info["node_id"] for i in dep.instances} == {
            "prefill-0": node_of_resource["prefill_node"],
            "decode-0": node_of_resource["decode_node"],
            "decode-1": node_of_resource["decode_node"]}
        assert ask(dep.url)["served_by"]["role"] == "decode"
    with pytest.raises(LaunchError, match="no node of the Ray cluster carries the labels "
                       r"\{'pd-role': 'gpu'\} asked for decode"):
        with Deployment(config(decode={"node_labels": {"pd-role": "gpu"}})):
            pass


def test_killed_instance_is_restarted(ray_cluster):
    with Deployment(config(max_restarts=2)) as dep:
        dec = dep.role_instances("decode")[0]
        before = ask(dep.url)["served_by"]
        os.kill(before["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            st = dep.poll()[1]
            if st["restarts"] == 1 and st["state"] == "healthy":
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.5)
        assert st["exits"] == [-signal.SIGKILL]
        # the killed server's child (vLLM's engine core) went with it
        assert gone([before["child_pid"]]) == []
        after = ask(dep.url)["served_by"]
        assert after["pid"] != before["pid"] and after["port"] == before["port"]
        assert dec.status["pid"] == after["pid"]


def test_dead_supervisor_takes_its_server_along(ray_cluster, tmp_path):
    """The actor's process dies (node agent kill, OOM): its server and the
    server's child stop too (PDEATHSIG), and the deployment reports it. With
    ExampleConnector in a user-given folder, the deployment's subfolder still
    goes (the other supervisor and the launcher see it), and the stop says
    on which node it may remain if that node's folder is not shared."""
    user = tmp_path / "kv"
    user.mkdir()
    (user / "notes.txt").write_text("the user's")
    lines: list[str] = []
    with Deployment(config(log_dir=str(tmp_path / "logs"), connector="ExampleConnector",
                           kv_connector_extra_config={"shared_storage_path": str(user)},
                           recovery_timeout_s=0),  # the role's only one: stop
                    progress=lines.append) as dep:  # failure: logs kept
        dec = dep.role_instances("decode")[0]
        pids = [p.pid for p in psutil.process_iter() if _pgid(p.pid) == dec.status["pid"]]
        assert len(pids) == 2
        os.kill(dec.info["actor_pid"], signal.SIGKILL)
        assert gone(pids) == []
        with pytest.raises(LaunchError, match="decode-0: its supervisor actor died"):
            deadline = time.monotonic() + 60
            dep.serve_forever(poll_s=0.5, until=lambda: time.monotonic() > deadline)
        own = user / f"vllm-patch-{dep.id}"
        assert own.is_dir()
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt"]
    text = "\n".join(lines)
    assert f"the KV cache folder {own} may remain on node(s) {dec.info['ip']}, whose " \
        "supervisor was gone at the stop" in text, text


class _Unavailable:
    """Stands in for a supervisor actor handle: its first `n` status polls
    fail with Ray's transient ActorUnavailableError, then the real actor
    answers."""

    def __init__(self, actor, n: int) -> None:
        import ray

        @ray.remote(num_cpus=0)
        def unavailable():
            raise ray.exceptions.ActorUnavailableError("RpcError: Connection reset "
                                                       "by peer", None)

        self._actor, self._n, self._fail = actor, n, unavailable
        self.status = self

    def remote(self):
        if self._n > 0:
            self._n -= 1
            return self._fail.remote()
        return self._actor.status.remote()

    def __getattr__(self, name):
        return getattr(self._actor, name)


def test_unreachable_supervisor_is_not_a_death(ray_cluster):
    """Ray's transient errors (ActorUnavailableError, no answer in time:
    a partitioned or frozen node) are not deaths within the grace period:
    the node is logged as unreachable, polling goes on, the deployment
    keeps serving; past the grace period it is one."""
    lines: list[str] = []
    with Deployment(config(unreachable_grace_s=30), progress=lines.append) as dep:
        dec = dep.role_instances("decode")[0]
        real = dec.actor
        dec.actor = _Unavailable(real, 3)
        sts = [s["state"] for s in (dep.poll()[1] for _ in range(3))]
        assert sts == ["unreachable"] * 3
        assert ask(dep.url)["served_by"]["role"] == "decode"  # still serving
        assert dep.poll()[1]["state"] == "healthy"
        dec.actor = real
        # a frozen supervisor (no answer): SIGSTOP its process
        dep.status_timeout_s = 1.0
        os.kill(dec.info["actor_pid"], signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 5
            dep.serve_forever(poll_s=0.5, until=lambda: time.monotonic() > deadline)
            assert dep.poll()[1]["state"] == "unreachable"
        finally:
            os.kill(dec.info["actor_pid"], signal.SIGCONT)
        deadline = time.monotonic() + 30
        while dep.poll()[1]["state"] != "healthy":
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert ask(dep.url)["served_by"]["role"] == "decode"
    text = "\n".join(lines)
    assert re.search(r"decode-0 on node \S+ unreachable \(The actor \S+ is unavailable: "
                     r"RpcError: Connection reset by peer.*polling it again for up to "
                     r"30 s", text), text
    assert "decode-0 on node" in text and "unreachable (no answer within 1 s)" in text
    assert text.count("reachable again after") == 2, text

    # past the grace period: a death (the role's only instance, and no
    # wait for its recovery: the deployment stops)
    with Deployment(config(unreachable_grace_s=2, recovery_timeout_s=0)) as dep:
        dec = dep.role_instances("decode")[0]
        dep.status_timeout_s = 0.5
        os.kill(dec.info["actor_pid"], signal.SIGSTOP)
        try:
            with pytest.raises(LaunchError, match=r"decode-0 on node \S+ unreachable for "
                               r"more than 2 s \(--unreachable-grace\): no answer"):
                deadline = time.monotonic() + 30
                dep.serve_forever(poll_s=0.5, until=lambda: time.monotonic() > deadline)
        finally:
            os.kill(dec.info["actor_pid"], signal.SIGCONT)


def test_restarts_are_bounded(ray_cluster, tmp_path):
    """A server that was healthy and keeps dying is restarted max_restarts
    times; each restart line names the new pid and the exit cause."""
    cfg = config(max_restarts=1, log_dir=str(tmp_path),  # failure: logs kept
                 decode={"node_resource": "decode_node",
                         "env": {"STANDIN_CRASH_AFTER_S": "4"}})
    deadline = time.monotonic() + 60
    lines: list[str] = []
    with pytest.raises(LaunchError) as e:
        with Deployment(cfg, progress=lines.append) as dep:
            first = dep.role_instances("decode")[0].status["pid"]
            dep.serve_forever(poll_s=0.5, until=lambda: time.monotonic() > deadline)
    msg = str(e.value)
    assert "decode-0: server exited with code 3 (exit code 3)" in msg, msg
    assert "restarted 1 time(s), the maximum (max_restarts=1)" in msg, msg
    assert "===== start" in msg  # the server's log tail is part of the error
    restart = [line for line in lines if "decode-0 exited" in line]
    assert len(restart) == 1 and "(code 3: exit code 3); restarted (1/1) as pid" in \
        restart[0], lines
    assert int(restart[0].rsplit(" ", 1)[1]) != first  # the new server's pid


@pytest.mark.parametrize("kw, expected", [
    (dict(decode={"node_resource": "gpu_island"}),
     "unknown node resource 'gpu_island' for decode"),
    (dict(model="/no/such/model"), "model path /no/such/model does not exist"),
])
def test_bad_config_is_refused(ray_cluster, kw, expected):
    with pytest.raises(LaunchError, match=expected.replace("(", r"\(")):
        with Deployment(config(**kw)):
            pass


def test_port_in_use_is_refused(ray_cluster):
    import ray.util

    ip = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((ip, 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LaunchError, match=f"prefill-0 on node {ip}: port {port} is "
                           "already in use"):
            with Deployment(config(prefill={"node_resource": "prefill_node", "port": port})):
                pass
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LaunchError, match=f"router port 127.0.0.1:{port} is already "
                           "in use"):
            with Deployment(config(router={"port": port})):
                pass


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: m\nprefill: {count: 0, nodes: x}\nvllm_args: [--port, '1']\n")
    with pytest.raises(LaunchError) as e:
        load(str(bad))
    msg = str(e.value)
    assert "prefill.count: Input should be greater than or equal to 1" in msg
    assert "prefill.nodes: Extra inputs are not permitted" in msg
    assert "--port are set by the launcher" in msg
    with pytest.raises(LaunchError, match="config file not found"):
        load(str(tmp_path / "missing.yaml"))
    (tmp_path / "list.yaml").write_text("- a\n")
    with pytest.raises(LaunchError, match="must hold a mapping"):
        load(str(tmp_path / "list.yaml"))
    good = tmp_path / "good.yaml"
    good.write_text("model: m\nvllm_args: --max-model-len 512\n"
                    "decode: {count: 2, vllm_args: [--seed, '1']}\n")
    cfg = load(str(good), {"decode": {"node_resource": "d"}, "router": {"port": 9}})
    assert cfg.vllm_args == ["--max-model-len", "512"]
    assert (cfg.decode.count, cfg.decode.node_resource, cfg.decode.vllm_args) == \
        (2, "d", ["--seed", "1"])
    assert cfg.router.port == 9


def test_progress_is_logged_and_shown():
    """Progress lines go through logging (vllm_patch.launch.deployment) and
    to a `progress` callback; show_progress() prints them as the commands
    do, warnings marked with their level."""
    import io
    import logging

    from vllm_patch import launch

    log = logging.getLogger("vllm_patch.launch")
    saved = (list(log.handlers), log.level, log.propagate)
    out, lines = io.StringIO(), []
    try:
        launch.show_progress(out)
        launch.show_progress(out)  # idempotent: one handler
        dep = Deployment(config(), progress=lines.append)
        dep._say("placed")
        dep._say("instances share one core", logging.WARNING)
    finally:
        log.handlers[:], log.propagate = saved[0], saved[2]
        log.setLevel(saved[1])
    assert [line.split("] ", 1)[1] for line in lines] == [
        "placed", "instances share one core"]
    assert out.getvalue().splitlines() == [lines[0], "WARNING: " + lines[1]]


def test_cpu_bind_ranges():
    assert cpu_bind_ranges([0, 1], 2) == ["0", "1"]
    assert cpu_bind_ranges(list(range(8)), 3) == ["0-1", "2-4", "5-7"]
    assert cpu_bind_ranges([0, 1], 3) is None          # more instances than cores
    assert cpu_bind_ranges([0, 2, 3, 5], 2) is None    # holes: leave vLLM's default


def test_cli_launch_and_sigint(ray_cluster, tmp_path):
    """The command a user runs: YAML + flags, endpoint printed, SIGINT tears
    everything down and exits 0, also when the command was started in the
    background by a non-interactive shell (SIGINT ignored on entry), and
    the deployment's temp folder (logs, vLLM's sockets) is gone."""
    cfg = tmp_path / "pd.yaml"
    cfg.write_text(f"model: standin\nserver_command: {json.dumps(STANDIN)}\n"
                   "env: {VLLM_CPU_KVCACHE_SPACE: '1'}\n"
                   "prefill: {node_resource: prefill_node}\n"
                   "decode: {node_resource: decode_node}\n")
    ready = tmp_path / "ready.json"
    exe = Path(sys.executable).with_name("vllm-patch")
    proc = subprocess.Popen(
        [str(exe), "launch", "--config", str(cfg), "--address", ray_cluster.address,
         "--port", "0", "--ready-file", str(ready), "--", "--max-model-len", "512"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # `cmd &`
    try:
        info = wait_ready(proc, ready, 90)
        assert ask(info["url"])["served_by"]["role"] == "decode"
        pgids = [i["pid"] for i in info["instances"]]
        pids = [p.pid for p in psutil.process_iter() if _pgid(p.pid) in pgids]
        cmdlines = [" ".join(psutil.Process(p).cmdline()) for p in pgids]
        assert all("--max-model-len 512" in c for c in cmdlines), cmdlines
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert f"endpoint: {info['url']}" in out
    assert "stopping 2 instance(s)" in err
    assert gone(pids) == []
    folder = Path(re.search(r"log (\S+)/prefill-0\.log", err).group(1))
    assert folder.name.startswith("vllm-patch-launch-") and not folder.exists(), err
    assert "logs kept" not in err


def test_cli_kv_folder_in_a_users_path_goes_at_sigint(ray_cluster, tmp_path):
    """ExampleConnector with a shared_storage_path the user gives: the
    deployment's KV files go to a folder of its own in it, named in the
    start-up output and made before the servers start; SIGINT removes that
    folder with everything in it, and the user's own files stay."""
    user = tmp_path / "kv"
    user.mkdir()
    (user / "notes.txt").write_text("the user's")
    ready = tmp_path / "ready.json"
    exe = Path(sys.executable).with_name("vllm-patch")
    proc = subprocess.Popen(
        [str(exe), "launch", "--model", "standin", "--server-command", " ".join(STANDIN),
         "--address", ray_cluster.address, "--port", "0", "--ready-file", str(ready),
         "--prefill-resource", "prefill_node", "--decode-resource", "decode_node",
         "--connector", "ExampleConnector",
         "--kv-connector-extra-config", json.dumps({"shared_storage_path": str(user)}),
         "--", "--kv-cache-memory-bytes", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        info = wait_ready(proc, ready, 90)
        ask(info["url"])
        own = [p for p in user.iterdir() if p.name.startswith("vllm-patch-")]
        assert len(own) == 1 and own[0].is_dir(), own
        cmdlines = [" ".join(psutil.Process(i["pid"]).cmdline()) for i in info["instances"]]
        assert all(f'"shared_storage_path": "{own[0]}"' in c for c in cmdlines), cmdlines
        (own[0] / "5f3a").mkdir()  # what ExampleConnector writes: a folder per prompt
        (own[0] / "5f3a" / "model.layers.0.self_attn.attn.safetensors").write_bytes(b"kv")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert re.search(rf"KV cache files \(ExampleConnector\) in {re.escape(str(own[0]))}, "
                     r"this deployment's own folder, removed when it stops\n", err), err
    assert err.index("KV cache files") < err.index("prefill-0 starting:"), err
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt"], err
    assert (user / "notes.txt").read_text() == "the user's"
    assert "Traceback" not in err and "WARNING" not in err, err


def test_cli_missing_kv_path_is_refused_before_any_server(ray_cluster, tmp_path):
    exe = Path(sys.executable).with_name("vllm-patch")
    missing = tmp_path / "not-mounted"
    r = subprocess.run(
        [str(exe), "launch", "--model", "standin", "--server-command", " ".join(STANDIN),
         "--address", ray_cluster.address, "--port", "0",
         "--prefill-resource", "prefill_node", "--decode-resource", "decode_node",
         "--connector", "ExampleConnector",
         "--kv-connector-extra-config", json.dumps({"shared_storage_path": str(missing)}),
         "--", "--kv-cache-memory-bytes", "1"],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    for name in ("prefill-0", "decode-0"):
        assert re.search(rf"^(error: )?{name} on node \S+: shared_storage_path "
                         rf"\(kv_connector_extra_config\) {re.escape(str(missing))} does "
                         r"not exist on this node", r.stderr, re.M), r.stderr
    assert "starting:" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not missing.exists()


def test_cli_signal_during_close_is_waited_for(ray_cluster, tmp_path):
    """A deployment closing after an error (an instance died for good) is
    not interrupted by SIGINT / SIGTERM: each is acknowledged, the close
    finishes (every server stopped, the deployment's folders gone), the
    error is printed and the exit code is 1."""
    import tempfile
    import threading

    exe = Path(sys.executable).with_name("vllm-patch")
    cfg = tmp_path / "pd.yaml"
    cfg.write_text(f"model: standin\nserver_command: {json.dumps(STANDIN)}\n"
                   "env: {VLLM_CPU_KVCACHE_SPACE: '1', STANDIN_STOP_DELAY_S: '6'}\n"
                   "max_restarts: 0\n"
                   "prefill: {node_resource: prefill_node}\n"
                   "decode: {node_resource: decode_node, "
                   "env: {STANDIN_CRASH_AFTER_S: '3'}}\n")
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("vllm-patch-launch-*"))
    proc = subprocess.Popen(
        [str(exe), "launch", "--config", str(cfg), "--address", ray_cluster.address,
         "--port", "0", "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 90
        while not any("stopping 2 instance(s)" in line for line in err):
            assert proc.poll() is None, "".join(err)
            assert time.monotonic() < deadline, "".join(err)
            time.sleep(0.1)
        pids = [int(m) for line in err
                for m in re.findall(r"starting: \S+ pid (\d+)", line)]
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(err)
    assert proc.returncode == 1, text
    assert "SIGINT: already stopping, please wait" in text, text
    assert "SIGTERM: already stopping, please wait" in text, text
    assert re.search(r"^error: decode-0: ", text, re.M), text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert text.rstrip().splitlines()[-1].startswith("error: ") or \
        "] stopped" in text, text
    assert len(pids) == 2 and gone(pids) == []
    assert set(tmp.glob("vllm-patch-launch-*")) - before == set(), text
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "decode-0.log", "prefill-0.log"]  # the user's log folder: kept


def test_cli_long_tmpdir_local_ray(tmp_path):
    """With a 60-character TMPDIR (CI runners, pam_tmpdir, SLURM job
    folders) the command, starting its own local Ray cluster, works: Ray's
    files go to a short folder of their own, vLLM's sockets too, and
    nothing is left behind (in TMPDIR, in /tmp, in ~/.ray)."""
    tmpdir = Path("/tmp") / ("vp-long-tmpdir-" + "x" * 60)
    tmpdir = Path(str(tmpdir)[:60])
    assert len(str(tmpdir)) == 60
    tmpdir.mkdir()
    cfg = tmp_path / "pd.yaml"
    cfg.write_text(f"model: standin\nserver_command: {json.dumps(STANDIN)}\n"
                   "env: {VLLM_CPU_KVCACHE_SPACE: '1'}\n")
    ready = tmp_path / "ready.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_TMPDIR", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN",
                        "RAY_AUTH_TOKEN_PATH")}
    env["TMPDIR"] = str(tmpdir)
    token = Path.home() / ".ray" / "auth_token"
    token_before = token.read_bytes() if token.exists() else None
    exe = Path(sys.executable).with_name("vllm-patch")
    proc = subprocess.Popen(
        [str(exe), "launch", "--config", str(cfg), "--port", "0", "--ready-file",
         str(ready)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        info = wait_ready(proc, ready, 120)
        assert ask(info["url"])["served_by"]["role"] == "decode"
        # vLLM's socket folder: short enough for its <uuid4> socket names
        server_env = dict(e.split("=", 1) for e in Path(
            f"/proc/{info['instances'][0]['pid']}/environ").read_text().split("\0") if e)
        ipc = server_env["VLLM_RPC_BASE_PATH"]
        assert len(ipc) + 37 <= 107 and os.path.isdir(ipc), ipc
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    try:
        assert proc.returncode == 0, err
        assert re.search(r"starting a local Ray cluster \(its files in "
                         r"/tmp/vllm-patch-ray-\w+\)", err), err
        assert "Traceback" not in err, err
        assert list(tmpdir.iterdir()) == [], list(tmpdir.iterdir())
        dep_id = re.search(r"/tmp/vllm-patch-ray-(\w+)", err).group(1)
        assert ipc == f"/tmp/vllm-patch-ipc-{dep_id}"
        left = [p for p in (f"/tmp/vllm-patch-ray-{dep_id}", ipc) if os.path.exists(p)]
        assert left == [], left
        token_after = token.read_bytes() if token.exists() else None
        assert token_after == token_before, f"the launch left {token}"
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def test_ray_start_failure_is_one_line(monkeypatch):
    """Ray's start raising (a deterministic failure) is a LaunchError with
    its cause on one line, not a traceback; a folder too long for Ray's
    sockets is refused before anything starts, naming the limit."""
    import ray

    from vllm_patch.launch import deployment

    def boom(**kw):
        raise OSError("validate_socket_filename failed: AF_UNIX path length cannot "
                      "exceed 107 bytes: /x\nmore lines")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: None)  # the session's Ray stays
    monkeypatch.setattr(ray, "init", boom)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    dep = Deployment(config())
    with pytest.raises(LaunchError) as e:
        with dep:
            pass
    assert str(e.value) == ("could not start a local Ray cluster: OSError: "
                            "validate_socket_filename failed: AF_UNIX path length "
                            "cannot exceed 107 bytes: /x")
    assert not os.path.exists(f"/tmp/vllm-patch-ray-{dep.id}")  # removed
    dep = Deployment(config(address="127.0.0.1:1"))
    with pytest.raises(LaunchError, match=r"^could not connect to the Ray cluster at "
                       r"127.0.0.1:1: OSError: validate_socket_filename failed: [^\n]*$"):
        with dep:
            pass
    def refused(**kw):
        raise ray.exceptions.AuthenticationError("Token mismatch")

    monkeypatch.setattr(ray, "init", refused)
    with pytest.raises(LaunchError, match=r"AuthenticationError: .*must agree on Ray's "
                       r"token authentication.*RAY_AUTH_MODE=token"):
        with Deployment(config(address="127.0.0.1:1")):
            pass
    monkeypatch.setattr(deployment.tempfile, "gettempdir", lambda: "/t" + "x" * 60)
    monkeypatch.setattr(deployment.os, "mkdir", lambda *a: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied")))
    with pytest.raises(LaunchError, match=r"Ray's AF_UNIX socket paths \(at most 107 "
                       r"bytes\) need a short, writable folder \(/tmp: Permission denied; "
                       r"/t x+: too long\); make /tmp writable, set TMPDIR".replace(" x", "x")):
        deployment.ray_folder("abcd1234")


def test_ray_token_of_the_launch_is_removed(monkeypatch, tmp_path):
    """A local Ray cluster's token goes in the launch's own Ray folder
    (RAY_AUTH_TOKEN_PATH while it runs, restored after); a default token
    file (~/.ray/auth_token) that the start created is removed at close,
    one that existed before never is; a token the user configured is left
    alone."""
    import ray

    from vllm_patch.launch import deployment

    default = tmp_path / ".ray" / "auth_token"
    monkeypatch.setattr(deployment, "RAY_DEFAULT_TOKEN", default)
    for k in deployment.RAY_AUTH_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: None)  # the session's Ray stays
    seen = {}

    def init(**kw):  # Ray writes its default token, then fails to start
        seen["path"] = os.environ.get("RAY_AUTH_TOKEN_PATH")
        seen["token"] = Path(seen["path"]).read_text()
        default.parent.mkdir(exist_ok=True)
        default.write_text("ray's")
        raise RuntimeError("no")

    monkeypatch.setattr(ray, "init", init)
    dep = Deployment(config())
    with pytest.raises(LaunchError, match="could not start a local Ray cluster"):
        with dep:
            pass
    assert seen["path"] == f"/tmp/vllm-patch-ray-{dep.id}/ray-auth-token"
    assert len(seen["token"]) == 64
    assert "RAY_AUTH_TOKEN_PATH" not in os.environ
    assert not default.exists() and not default.parent.exists()
    # one that was there before stays
    default.parent.mkdir()
    default.write_text("theirs")
    with pytest.raises(LaunchError):
        with Deployment(config()):
            pass
    assert default.read_text() == "ray's"  # (what the fake Ray wrote over it)
    # a token the user configured: not replaced
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/theirs")
    with pytest.raises(LaunchError):
        with Deployment(config()):
            pass
    assert seen["path"] == "/theirs" and os.environ["RAY_AUTH_TOKEN_PATH"] == "/theirs"


def test_cli_start_failure_fails_fast(ray_cluster):
    """A server that fails the same way twice before it is healthy stops the
    command at once with the cause; restart lines name the new pid; the
    logs are kept (and said where), nothing else."""
    exe = Path(sys.executable).with_name("vllm-patch")
    t0 = time.monotonic()
    r = subprocess.run(
        [str(exe), "launch", "--model", "standin", "--address", ray_cluster.address,
         "--port", "0", "--connector", "ExampleConnector", "--server-command",
         "{python} -c \"raise ValueError('model /m is not a model')\"",
         "--", "--kv-cache-memory-bytes", "1"],
        capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    assert took < 60, took
    assert re.search(r"error: (prefill|decode)-0: the server failed to start twice with "
                     r"the same error, not restarted again: ValueError: model /m is not a "
                     r"model\nlast lines of ", r.stderr), r.stderr
    started = {m[0]: int(m[1]) for m in re.findall(r"(\w+-0) starting: \S+ pid (\d+)",
                                                   r.stderr)}
    for name, pid in re.findall(r"(\w+-0) exited \(code 1: ValueError: model /m is not a "
                                r"model\); restarted \(1/3\) as pid (\d+)", r.stderr):
        assert int(pid) != started[name]
    kept = re.search(r"logs kept: (\S+?)(?:,|\n)", r.stderr).group(1)
    folder = Path(kept).parent
    try:
        assert sorted(p.name for p in folder.iterdir()) == [
            "decode-0.log", "prefill-0.log"]  # no KV storage, no sockets
    finally:
        shutil.rmtree(folder)


def test_cli_errors_exit_nonzero(ray_cluster):
    exe = Path(sys.executable).with_name("vllm-patch")
    r = subprocess.run([str(exe), "launch", "--model", "standin", "--address",
                        ray_cluster.address, "--decode-resource", "nowhere"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "error: unknown node resource 'nowhere' for decode" in r.stderr
    r = subprocess.run([str(exe), "launch", "--prefill", "0"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "model: Field required" in r.stderr, r.stderr


def _wait(dep: Deployment, cond, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        dep.poll()  # raises LaunchError if the deployment would stop
        assert time.monotonic() < deadline
        time.sleep(0.5)


def test_a_node_lost_with_survivors_keeps_serving_and_rejoins(ray_cluster):
    """1 prefill + 2 decode, the decode instances on two nodes (a second
    decode node is added for this test). The node of one decode instance
    leaves the cluster (its Ray processes and its server killed): the deployment does not stop, says what
    happened, and serves every request on the surviving decode instance;
    when a node with the decode resource joins again, the lost instance is
    started there and rejoins, and the router balances over both again.
    (Before, the launcher stopped the whole deployment: "its supervisor
    actor died".)"""
    import ray

    extra = ray_cluster.add_node(num_cpus=1, resources={"decode_node": 1})
    ray_cluster.wait_for_nodes()
    lines: list[str] = []
    try:
        with Deployment(config(decode={"node_resource": "decode_node", "count": 2}),
                        progress=lines.append) as dep:
            decs = dep.role_instances("decode")
            assert len({d.info["node_id"] for d in decs}) == 2  # spread
            served = {ask(dep.url)["served_by"]["port"] for _ in range(4)}
            assert served == {d.status["port"] for d in decs}  # balanced
            lost = next(d for d in decs if d.info["node_id"] == extra.node_id)
            survivor = next(d for d in decs if d is not lost)
            pgid = lost.status["pid"]
            pids = [p.pid for p in psutil.process_iter() if _pgid(p.pid) == pgid]
            # the node gone: its Ray processes killed. The server and its
            # child (vLLM's engine core) go with them: the supervisor's
            # process ends, and the server's guard stops the whole group
            # (before the guard the child was left running, its parent gone)
            ray_cluster.remove_node(extra, allow_graceful=False)
            extra = None
            assert gone(pids) == []
            _wait(dep, lambda: lost.lost_since is not None)
            text = "\n".join(lines)
            assert f"{lost.name} on node {lost.info['ip']} lost: its supervisor actor " \
                "died" in text, text
            assert f"The deployment keeps serving: decode requests go to " \
                f"{survivor.name}" in text, text
            for _ in range(4):  # every request on the survivor, none fails
                assert ask(dep.url)["served_by"]["port"] == survivor.status["port"]
            # /health: 503 while it is lost (the deployment is not whole)
            r = requests.get(dep.url + "/health", timeout=30)
            assert r.status_code == 503 and r.json()[lost.url] == 599, r.text
            assert [s["state"] for s in dep.poll()].count("lost") == 1
            # the node back (a new Ray worker with the decode resource)
            extra = ray_cluster.add_node(num_cpus=1, resources={"decode_node": 1})
            ray_cluster.wait_for_nodes()
            _wait(dep, lambda: lost.live and lost.status.get("state") == "healthy")
            assert lost.info["node_id"] == extra.node_id
            text = "\n".join(lines)
            assert f"{lost.name} started again on node" in text, text
            assert f"{lost.name} rejoined: the router sends decode requests to " in text
            served = {ask(dep.url)["served_by"]["port"] for _ in range(4)}
            assert served == {d.status["port"] for d in dep.role_instances("decode")}
            assert len(served) == 2
            assert requests.get(dep.url + "/health", timeout=30).status_code == 200
    finally:
        if extra is not None:
            ray_cluster.remove_node(extra)
        assert ray.is_initialized()


def test_the_last_instance_of_a_role_lost_is_started_again(ray_cluster):
    """Every instance of a role lost (their supervisors killed; their node
    stays): the deployment does not stop. The router answers that role's
    requests with a clean 503 at once, /health is 503, the launcher says
    what happened and how long it waits; both instances are started again
    on their node and the deployment serves again. (Before, losing a
    role's last instance stopped the deployment.)"""
    lines: list[str] = []
    with Deployment(config(decode={"node_resource": "decode_node", "count": 2}),
                    progress=lines.append) as dep:
        a, b = dep.role_instances("decode")  # both on the one decode node
        os.kill(a.info["actor_pid"], signal.SIGKILL)
        # a lost, then restarted on its own node (it is still in the cluster)
        _wait(dep, lambda: a.lost_since is not None or a.rejoining or a.pending)
        _wait(dep, lambda: a.live and a.status.get("state") == "healthy")
        assert ask(dep.url)["served_by"]["role"] == "decode"
        os.kill(a.info["actor_pid"], signal.SIGKILL)
        os.kill(b.info["actor_pid"], signal.SIGKILL)
        _wait(dep, lambda: not dep.role_instances("decode"))
        text = "\n".join(lines)
        assert "No decode instance serves now: requests get a 503 until" in text, text
        assert "the deployment stops if none serves within 600 s (--recovery-timeout)" \
            in text, text
        r = requests.post(dep.url + "/v1/completions", json={"prompt": "x",
                                                              "max_tokens": 4}, timeout=30)
        assert r.status_code == 503 and "no decode instance is serving" in r.text, r.text
        assert requests.get(dep.url + "/health", timeout=30).status_code == 503
        _wait(dep, lambda: all(i.live and i.status.get("state") == "healthy"
                               for i in (a, b)))
        assert {ask(dep.url)["served_by"]["port"] for _ in range(4)} == \
            {a.status["port"], b.status["port"]}
        assert requests.get(dep.url + "/health", timeout=30).status_code == 200
        assert "decode serves again after" in "\n".join(lines)


@pytest.mark.parametrize("timeout_s", [0, 4])
def test_a_role_without_a_node_stops_after_the_recovery_timeout(ray_cluster, timeout_s):
    """The only decode node leaves the cluster and does not come back: the
    deployment stops once --recovery-timeout has passed (at once with 0,
    the behaviour before there was a wait), naming the cause; the lost
    server's processes are gone with its node (the guard)."""
    extra = ray_cluster.add_node(num_cpus=1, resources={"lone_node": 1})
    ray_cluster.wait_for_nodes()
    try:
        with Deployment(config(decode={"node_resource": "lone_node"},
                               recovery_timeout_s=timeout_s)) as dep:
            dec = dep.role_instances("decode")[0]
            pgid = dec.status["pid"]
            pids = [p.pid for p in psutil.process_iter() if _pgid(p.pid) == pgid]
            ray_cluster.remove_node(extra, allow_graceful=False)
            extra = None
            assert gone(pids) == []
            t0 = time.monotonic()
            expected = ("its supervisor actor died" if timeout_s == 0 else
                        f"no decode instance has served for {timeout_s} s "
                        "\\(--recovery-timeout\\): decode-0: its supervisor actor died")
            with pytest.raises(LaunchError, match=expected):
                dep.serve_forever(poll_s=0.5, until=lambda: time.monotonic() - t0 > 60)
            if timeout_s:
                assert time.monotonic() - t0 >= timeout_s
    finally:
        if extra is not None:
            ray_cluster.remove_node(extra)
