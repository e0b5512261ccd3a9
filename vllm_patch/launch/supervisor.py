"""One P/D instance: a Ray actor that starts and supervises one vLLM OpenAI
server process on its node.

Why a subprocess and not vLLM inside the actor: vLLM on the CPU rewrites its
process environment and spawns its own engine-core and worker processes, and
`distributed_executor_backend="ray"` is not supported there
(../shared/research/vllm-disagg-audit.md section 5.2). A subprocess keeps
vLLM's processes out of Ray's worker and lets the same launcher drive CUDA
instances that use Ray internally.

Lifecycle guarantees:
- the server runs in its own session (process group); stop() signals only
  that group: SIGTERM, then SIGKILL after a grace period, so the engine core
  and workers go with it;
- the server gets PR_SET_PDEATHSIG(SIGTERM): if the actor's process dies, the
  kernel signals the server even when nobody calls stop(); SIGTERM, not
  SIGKILL, because vLLM's server shuts its engine core and workers down on
  SIGTERM while they outlive a killed server; every process is spawned from
  the supervisor's own long-lived thread, because the death signal follows
  the thread that forked;
- an unexpected exit is restarted on the same host and port (so the router's
  address stays valid) up to `max_restarts` times, then the instance is
  `failed` and the deployment stops with the server's last log lines.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from vllm_patch.launch.config import LaunchError, model_is_path

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # preexec_fn: runs in the child before exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_ip() -> str:
    try:
        import ray.util

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (unit use)
        return "127.0.0.1"


def kill_group(pgid: int, grace_s: float, proc: subprocess.Popen | None = None) -> None:
    """SIGTERM the group, wait for the leader, then SIGKILL whatever is left."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if proc is not None:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + (0 if proc is not None else grace_s)
    while time.monotonic() < deadline and group_alive(pgid):
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 10
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)


def group_alive(pgid: int) -> bool:
    """Any live (non-zombie) process in the group?"""
    import psutil

    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return False


class InstanceSupervisor:
    """Runs inside a Ray actor (`ray.remote(InstanceSupervisor)`); also usable
    directly (tests). All methods return plain data."""

    def __init__(self, name: str, max_restarts: int = 3, log_dir: str | None = None,
                 health_timeout_s: float = 2.0) -> None:
        self.name = name
        self.max_restarts = max_restarts
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="vllm-patch-launch-"))
        self.health_timeout_s = health_timeout_s
        self.cmd: list[str] = []
        self.env: dict[str, str] = {}
        self.host = node_ip()
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.state = "new"
        self.restarts = 0
        self.exits: list[int] = []
        self.started_at = 0.0
        self.error = ""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._spawned = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._log_file: Any = None

    # ---- before start -------------------------------------------------
    def node_info(self) -> dict[str, Any]:
        node_id = None
        try:
            import ray

            node_id = ray.get_runtime_context().get_node_id()
        except Exception:
            pass
        return {"ip": self.host, "node_id": node_id, "hostname": socket.gethostname(),
                "cpus": sorted(os.sched_getaffinity(0)), "python": sys.executable,
                "actor_pid": os.getpid()}

    def prepare(self, model: str, port: int | None, env: dict[str, str]) -> dict[str, Any]:
        """Checks that need the node; returns the ports to use. Raises
        LaunchError with the node's address in the message."""
        where = f"{self.name} on node {self.host}"
        for mod in ("vllm", "vllm_patch"):
            if importlib.util.find_spec(mod) is None:
                raise LaunchError(f"{where}: Python package {mod!r} is not installed "
                                  f"for {sys.executable}")
        plugins = env.get("VLLM_PLUGINS", os.environ.get("VLLM_PLUGINS"))
        if plugins is not None and "vllm_patch" not in plugins.split(","):
            raise LaunchError(f"{where}: VLLM_PLUGINS={plugins!r} leaves the vllm_patch "
                              "plugin out; its guarantees would not be enforced")
        if model_is_path(model) and not Path(model).expanduser().exists():
            raise LaunchError(f"{where}: model path {model} does not exist")
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise LaunchError(f"{where}: cannot create log dir {self.log_dir}: {e}") from None
        if port is None:
            port = free_port(self.host)
        elif not port_free(self.host, port):
            raise LaunchError(f"{where}: port {port} is already in use")
        return {"port": port, "side_channel_port": free_port(self.host)}

    # ---- running ------------------------------------------------------
    def start(self, cmd: list[str], env: dict[str, str], port: int) -> dict[str, Any]:
        self.cmd = [sys.executable if a == "{python}" else a for a in cmd]
        self.env = {**os.environ, **env}
        self.port = port
        self.state = "starting"
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"supervise-{self.name}")
        self._thread.start()
        self._spawned.wait(30)
        return self.status(check_health=False)

    def _spawn(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
        self._log_file = open(self.log_dir / f"{self.name}.log", "ab")
        self._log_file.write(f"\n===== start {time.strftime('%H:%M:%S')} "
                             f"(restart {self.restarts}) {' '.join(self.cmd)}\n".encode())
        self._log_file.flush()
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=self._log_file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        self.started_at = time.monotonic()
        self._spawned.set()

    def _spawn_or_fail(self) -> bool:
        try:
            self._spawn()
            return True
        except OSError as e:  # e.g. the server command does not exist
            with self._lock:
                self.state = "failed"
                self.error = f"{self.name}: cannot start {self.cmd[:3]}: {e}"
            self._spawned.set()
            return False

    def _run(self) -> None:
        if not self._spawn_or_fail():
            return
        while True:
            self._wake.wait(0.5)
            with self._lock:
                if self._stopping:
                    return
                assert self.proc is not None
                rc = self.proc.poll()
                if rc is None:
                    continue
                self.exits.append(rc)
                pgid = self.proc.pid
            kill_group(pgid, 5.0)  # engine core / workers left behind
            with self._lock:
                if self._stopping:
                    return
                if self.restarts >= self.max_restarts:
                    self.state = "failed"
                    self.error = (f"{self.name}: server exited with code {rc} and was "
                                  f"restarted {self.restarts} time(s), the maximum "
                                  f"(max_restarts={self.max_restarts})")
                    return
                self.restarts += 1
                self.state = "restarting"
            time.sleep(min(2.0 * self.restarts, 10.0))
            deadline = time.monotonic() + 30
            while not port_free(self.host, self.port) and time.monotonic() < deadline:
                time.sleep(0.5)
            with self._lock:
                if self._stopping:
                    return
                if not self._spawn_or_fail():
                    return
                self.state = "starting"

    def healthy(self) -> bool:
        url = f"http://{self.host}:{self.port}/health"
        try:
            with urllib.request.urlopen(url, timeout=self.health_timeout_s) as r:
                return r.status == 200
        except OSError:
            return False

    def status(self, check_health: bool = True) -> dict[str, Any]:
        with self._lock:
            state = self.state
            proc = self.proc
        if check_health and state in ("starting", "healthy") and proc is not None \
                and proc.poll() is None:
            state = "healthy" if self.healthy() else "starting"
            with self._lock:
                if self.state in ("starting", "healthy"):
                    self.state = state
        return {"name": self.name, "state": state, "host": self.host, "port": self.port,
                "url": f"http://{self.host}:{self.port}",
                "pid": proc.pid if proc is not None else None,
                "restarts": self.restarts, "exits": list(self.exits), "error": self.error,
                "uptime_s": time.monotonic() - self.started_at if proc else 0.0,
                "log": str(self.log_dir / f"{self.name}.log")}

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = (self.log_dir / f"{self.name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(lines.splitlines()[-n:])

    def stop(self, grace_s: float = 20.0) -> dict[str, Any]:
        with self._lock:
            self._stopping = True
            proc = self.proc
            self._wake.set()
        if proc is not None:
            kill_group(proc.pid, grace_s, proc)
        if self._thread is not None:
            self._thread.join(10)
        if self._log_file is not None:
            self._log_file.close()
        self.state = "stopped"
        return self.status(check_health=False)
