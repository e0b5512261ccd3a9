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
- that is not enough when Ray itself ends the actor's process (its node
  declared dead, the actor killed): Ray SIGKILLs a dying worker's direct
  children, so the server dies at once and its engine core is left; each
  server therefore has a guard (guard.py), a detached process that stops
  the server's whole group (SIGTERM, SIGKILL after GUARD_GRACE_S) when this
  process ends;
- an unexpected exit is restarted on the same host and port (so the router's
  address stays valid) up to `max_restarts` times, then the instance is
  `failed` and the deployment stops with the server's last log lines; a
  server that never became healthy and fails a second time with the same
  error (a deterministic start failure: bad model, not enough memory) is not
  restarted again;
- logs go to one folder per deployment on each node: the `log_dir` given, or
  `<temp dir>/vllm-patch-launch-<deployment id>`, which `cleanup()` removes
  unless the deployment failed (no empty folder is left either way);
- ExampleConnector's KV files go to a folder of this deployment's own
  (`kv_folder()`), which `prepare()` creates on the node and `cleanup()`
  removes, always, and nothing outside it: with a `shared_storage_path` the
  user gives, `<that path>/vllm-patch-<deployment id>`. A path shared by the
  nodes (NFS) is created by the first supervisor and removed by the first
  to clean up; a path local to each node is created and removed on each.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
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
# The guard that stops a server's process group when this process dies.
GUARD = str(Path(__file__).with_name("guard.py"))
GUARD_GRACE_S = 10.0
# An AF_UNIX socket path holds at most 107 bytes (sun_path, 108 with the
# final NUL). vLLM names its ZMQ IPC sockets VLLM_RPC_BASE_PATH/<uuid4>.
SOCKET_PATH_MAX = 107
VLLM_SOCKET_NAME_LEN = len("/") + 36
GiB = 1 << 30

# A Python exception line in a server log, vLLM's prefixes allowed:
# "ValueError: ...", "(VllmWorker-0 pid=12) ERROR 12-01 16:35:47
# [multiproc_executor.py:953] ValueError: ...".
_ERROR_LINE = re.compile(
    r"^(?:\(\S+ pid=\d+\)\s+)?(?:(?:ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\]\s+)?"
    r"((?:[A-Za-z_][\w.]*\.)?(?:[A-Z]\w*(?:Error|Exit)|Exception)(?::.*)?)$")
# vLLM's wrapper errors that only say "see above".
_GENERIC = ("Engine core initialization failed", "EngineDeadError",
            "EngineCore encountered an issue", "initialization failed due to an "
            "exception in a background process")


def exit_cause(log_text: str, code: int | None) -> str:
    """One line that says why a server exited: the first exception line of
    its log (vLLM's engine core prints the root cause before the API
    server's generic "Engine core initialization failed"), else the exit
    code. A server killed by SIGKILL (by hand, the OOM killer) is "killed
    by SIGKILL" whatever its log says: nothing of its own ran after the
    signal, and the exceptions logged before it are errors it handled
    while serving (a request cancelled: "RuntimeError: cancelled")."""
    if code == -signal.SIGKILL:
        return "killed by SIGKILL"
    lines = log_text.splitlines()
    found = []
    for i, line in enumerate(lines):
        m = _ERROR_LINE.match(line.strip())
        if not m:
            continue
        text = m.group(1).strip()
        if re.search(r"\d+ validation errors? for \w+$", text) and i + 1 < len(lines):
            # pydantic: the error itself is on the next (indented) line
            text += ": " + lines[i + 1].strip()
        found.append(text)
    specific = [e for e in found if not any(g in e for g in _GENERIC)]
    if specific or found:
        line = (specific or found)[0]
        return line if len(line) <= 240 else line[:240].rsplit(" ", 1)[0] + " ..."
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def same_cause(a: str, b: str) -> bool:
    """Two exit causes are the same error when they differ only in numbers
    (memory figures, pids, ports)."""
    return re.sub(r"\d+(?:\.\d+)?", "#", a) == re.sub(r"\d+(?:\.\d+)?", "#", b)


def node_memory(cpu: int) -> dict[str, int]:
    """Total and available memory of the NUMA node of `cpu`, as vLLM's CPU
    worker measures them (vllm.utils.cpu_resource_utils.get_memory_node_info:
    the node's meminfo, free + file cache + reclaimable slab, clamped to the
    cgroup's limit). Reimplemented here: importing vLLM into the supervisor
    actor would load torch (10 s, 0.5 GB) for a few file reads."""
    node = 0
    try:
        node = next(int(e[4:]) for e in os.listdir(f"/sys/devices/system/cpu/cpu{cpu}")
                    if e.startswith("node") and e[4:].isdigit())
    except (OSError, StopIteration):
        pass
    info: dict[str, int] = {}
    try:
        with open(f"/sys/devices/system/node/node{node}/meminfo") as f:
            for line in f:  # "Node 0 MemTotal:  97421888 kB"
                parts = line.split()
                info[parts[2].rstrip(":")] = int(parts[3]) * 1024
        total = info["MemTotal"]
        available = (info["MemFree"] + info["Active(file)"] + info["Inactive(file)"]
                     + info["SReclaimable"])
    except (OSError, KeyError, IndexError, ValueError):
        import psutil

        vm = psutil.virtual_memory()
        total, available = vm.total, vm.available

    def read(path: str) -> int | None:
        try:
            text = Path(path).read_text().strip()
            return None if not text or text == "max" else int(text)
        except (OSError, ValueError):
            return None

    limit, usage = read("/sys/fs/cgroup/memory.max"), read("/sys/fs/cgroup/memory.current")
    if limit is None:
        limit = read("/sys/fs/cgroup/memory/memory.limit_in_bytes")
        limit = None if limit is None or limit >= 1 << 62 else limit
        usage = read("/sys/fs/cgroup/memory/memory.usage_in_bytes") if limit else None
    if limit is not None and limit < total:
        total = limit
        available = max(0, min(available, limit - (usage or 0)))
    return {"node": node, "total": total, "available": available}


def _die_with_parent() -> None:  # preexec_fn: runs in the child before exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def ipc_folder(deployment_dir: Path, deployment_id: str) -> Path:
    """Where a server's vLLM IPC sockets go: the deployment's folder when
    VLLM_RPC_BASE_PATH/<uuid> fits in an AF_UNIX path there, else
    /tmp/vllm-patch-ipc-<id> (a long TMPDIR: CI runners, pam_tmpdir, SLURM)."""
    if len(os.fsencode(str(deployment_dir))) + VLLM_SOCKET_NAME_LEN <= SOCKET_PATH_MAX:
        return deployment_dir
    return Path("/tmp") / f"vllm-patch-ipc-{deployment_id}"


def kv_folder(user_path: str, deployment_id: str) -> str:
    """The deployment's own KV folder inside a `shared_storage_path` the
    user gave (ExampleConnector): `<path>/vllm-patch-<deployment id>`, the
    path made absolute as the launcher sees it."""
    return os.path.join(os.path.abspath(os.path.expanduser(user_path)),
                        f"vllm-patch-{deployment_id}")


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
                 health_timeout_s: float = 2.0, deployment_id: str = "") -> None:
        self.name = name
        self.max_restarts = max_restarts
        # The deployment's folder on this node: the user's log_dir (kept), or
        # a temp folder removed at the end unless the deployment failed.
        self.tmp_dir = Path(tempfile.gettempdir()) / (
            f"vllm-patch-launch-{deployment_id}" if deployment_id
            else f"vllm-patch-launch-{os.getpid()}-{name}")
        # vLLM's IPC sockets: in the deployment's folder when their paths fit
        # in an AF_UNIX address there, else in a short folder of their own
        self.ipc_dir = ipc_folder(self.tmp_dir, deployment_id or self.tmp_dir.name)
        self.user_log_dir = log_dir is not None
        self.log_dir = Path(log_dir).expanduser() if log_dir else self.tmp_dir
        self.health_timeout_s = health_timeout_s
        self.deployment_id = deployment_id
        # ExampleConnector's KV folder on this node, once prepare() made it
        self.kv_dir: Path | None = None
        self.cmd: list[str] = []
        self.env: dict[str, str] = {}
        self.host = node_ip()
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.state = "new"
        self.restarts = 0
        self.exits: list[int] = []
        self.causes: list[str] = []
        self.spawns = 0
        self.ever_healthy = False
        self._log_offset = 0
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
        cpus = sorted(os.sched_getaffinity(0))
        return {"ip": self.host, "node_id": node_id, "hostname": socket.gethostname(),
                "cpus": cpus, "python": sys.executable, "actor_pid": os.getpid(),
                "tmp_dir": str(self.tmp_dir), "log_dir": str(self.log_dir),
                "ipc_dir": str(self.ipc_dir),
                "memory": node_memory(cpus[0]),
                "kvcache_env": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")}

    def prepare(self, model: str, port: int | None, env: dict[str, str],
                kv_dir: str | None = None) -> dict[str, Any]:
        """Checks that need the node; creates the deployment's folders there
        (`kv_dir`: ExampleConnector's KV folder, see kv_folder()); returns
        the ports to use. Raises LaunchError with the node's address in the
        message."""
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
        for d in (self.tmp_dir, self.log_dir, self.ipc_dir):
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise LaunchError(f"{where}: cannot create folder {d}: {e}") from None
        if kv_dir is not None:
            self._make_kv_dir(Path(kv_dir), where)
        if port is None:
            port = free_port(self.host)
        elif not port_free(self.host, port):
            raise LaunchError(f"{where}: port {port} is already in use")
        return {"port": port, "side_channel_port": free_port(self.host)}

    def _make_kv_dir(self, kv_dir: Path, where: str) -> None:
        """The KV folder, in a parent folder that must exist: the user's
        shared_storage_path (never created here: across nodes it is meant
        to be a shared mount), or the deployment's own temp folder."""
        parent = kv_dir.parent
        if self._deployment_folder(parent):
            # the launcher's default: in the deployment's folder of the
            # prefill node, the same path on every node of one host
            try:
                parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise LaunchError(f"{where}: cannot create folder {parent}: {e}") from None
            what = "the deployment's folder"
        else:
            what = "shared_storage_path (kv_connector_extra_config)"
        if not parent.is_dir():
            reason = "is not a folder" if parent.exists() else "does not exist"
            raise LaunchError(f"{where}: {what} {parent} {reason} on this node (the KV "
                              "cache files go there: create it, shared by the nodes "
                              "when prefill and decode run on different hosts)")
        try:
            kv_dir.mkdir(exist_ok=True)  # exists: made by a node sharing the folder
        except OSError as e:
            raise LaunchError(f"{where}: {what} {parent} is not writable on this node "
                              f"(cannot create {kv_dir.name} in it: "
                              f"{e.strerror or e})") from None
        if not os.access(kv_dir, os.W_OK | os.X_OK):
            raise LaunchError(f"{where}: {what} {parent} is not writable on this node "
                              f"({kv_dir} cannot be written)")
        self.kv_dir = kv_dir

    def _deployment_folder(self, d: Path) -> bool:
        """Is `d` this deployment's temp folder (of this node or, same name,
        of another)?"""
        return d == self.tmp_dir or bool(
            self.deployment_id and d.name == f"vllm-patch-launch-{self.deployment_id}")

    def _own_kv_dir(self) -> Path | None:
        """The KV folder, if it is one this deployment may remove: in a
        deployment folder, or named for this deployment (never the user's
        path itself)."""
        d = self.kv_dir
        if d is None or d.is_symlink():
            return None
        if self._deployment_folder(d.parent):
            return d
        if self.deployment_id and d.name == f"vllm-patch-{self.deployment_id}":
            return d
        return None

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
        self._log_offset = self._log_file.tell()
        self._log_file.write(f"\n===== start {time.strftime('%H:%M:%S')} "
                             f"(restart {self.restarts}) {' '.join(self.cmd)}\n".encode())
        self._log_file.flush()
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=self._log_file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        self._start_guard(self.proc.pid)
        self.started_at = time.monotonic()
        self.spawns += 1
        self._spawned.set()

    def _start_guard(self, pgid: int) -> None:
        """The server's guard (guard.py): stops the server's process group
        if this process dies without stop(). It detaches at once (the first
        child exits and is reaped here)."""
        try:
            subprocess.run(
                [sys.executable, "-I", "-S", GUARD, str(os.getpid()), str(pgid),
                 str(GUARD_GRACE_S), str(self.log_dir / f"{self.name}.log")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True, timeout=30, check=True)
        except (OSError, subprocess.SubprocessError) as e:
            # the server runs; only its clean-up after this process dies is lost
            self._log_file.write(f"===== warning: the server's guard did not start "
                                 f"({type(e).__name__}: {e}): if this supervisor dies, "
                                 f"vLLM's engine core may outlive it\n".encode())
            self._log_file.flush()

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
            cause = exit_cause(self._run_log(), rc)
            with self._lock:
                if self._stopping:
                    return
                self.causes.append(cause)
                if (not self.ever_healthy and len(self.causes) >= 2
                        and self.exits[-2] == rc and same_cause(self.causes[-2], cause)):
                    self.state = "failed"
                    self.error = (f"{self.name}: the server failed to start twice with "
                                  f"the same error, not restarted again: {cause}")
                    return
                if self.restarts >= self.max_restarts:
                    self.state = "failed"
                    self.error = (f"{self.name}: server exited with code {rc} ({cause}) "
                                  f"and was restarted {self.restarts} time(s), the "
                                  f"maximum (max_restarts={self.max_restarts})")
                    return
                self.restarts += 1
                self.state = "restarting"
            # a start failure is retried at once (it fails fast when it
            # repeats); a server that was serving backs off
            time.sleep(min(2.0 * self.restarts, 10.0) if self.ever_healthy else 0.5)
            deadline = time.monotonic() + 30
            while not port_free(self.host, self.port) and time.monotonic() < deadline:
                time.sleep(0.5)
            with self._lock:
                if self._stopping:
                    return
                if not self._spawn_or_fail():
                    return
                self.state = "starting"

    def _run_log(self) -> str:
        """The log of the current (last) run of the server."""
        try:
            with open(self.log_dir / f"{self.name}.log", "rb") as f:
                f.seek(self._log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

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
                if self.state in ("starting", "healthy") and self.proc is proc:
                    self.state = state
                    self.ever_healthy = self.ever_healthy or state == "healthy"
        return {"name": self.name, "state": state, "host": self.host, "port": self.port,
                "url": f"http://{self.host}:{self.port}",
                "pid": proc.pid if proc is not None else None, "spawns": self.spawns,
                "restarts": self.restarts, "exits": list(self.exits),
                "causes": list(self.causes), "error": self.error,
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

    def cleanup(self, keep_logs: bool) -> dict[str, Any]:
        """After stop(): remove the KV folder (always: whichever supervisor
        of a node, or of the nodes sharing it, comes first), this instance's
        log unless it is kept, and the deployment's folders on this node
        once empty (the last instance there removes them). Returns
        {"log": the log's path if it is kept, "kv_dir": the KV folder if it
        could not be removed}."""
        kv_left = None
        kv = self._own_kv_dir()
        if kv is not None:
            for _ in range(10):  # NFS: a file still being closed comes back
                shutil.rmtree(kv, ignore_errors=True)
                if not kv.exists():
                    break
                time.sleep(0.3)
            else:
                kv_left = str(kv)
            if kv.parent != self.tmp_dir and self._deployment_folder(kv.parent):
                try:
                    kv.parent.rmdir()  # another node's folder name, made for it
                except OSError:
                    pass
        # vLLM's IPC sockets (VLLM_RPC_BASE_PATH points here), which a
        # server that failed leaves behind
        for d in {self.tmp_dir, self.ipc_dir}:
            try:
                for entry in d.iterdir():
                    if entry.is_socket():
                        entry.unlink(missing_ok=True)
            except OSError:
                pass
        log = self.log_dir / f"{self.name}.log"
        keep = keep_logs or self.user_log_dir
        if not keep:
            log.unlink(missing_ok=True)
        for d in {self.tmp_dir, self.log_dir, self.ipc_dir}:
            if d == self.log_dir and self.user_log_dir:
                continue  # the user's folder: never removed
            try:
                d.rmdir()  # only when empty
            except OSError:
                pass
        return {"log": str(log) if keep and log.exists() else None, "kv_dir": kv_left}
