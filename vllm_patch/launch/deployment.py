"""A P/D deployment on a Ray cluster: N prefill and M decode vLLM OpenAI
servers, each supervised by a Ray actor on its node, and the P/D router
(vllm_patch.launch.router) in front, in this process.

    with Deployment(cfg) as dep:      # places, starts, waits for /health
        print(dep.url)                # the router's endpoint
        dep.serve_forever()           # restarts, or raises LaunchError

Leaving the block (normally, on an error or on Ctrl-C) stops the router,
every server's process group and every actor, and the local Ray cluster if
this process started it. Nothing else is touched. Each node keeps the
deployment's files in one folder, `<temp dir>/vllm-patch-launch-<id>`:
server logs (unless `log_dir` is set), ExampleConnector's KV storage (with
a `shared_storage_path` given: in `<that path>/vllm-patch-<id>`, which the
supervisors create on their nodes) and vLLM's IPC sockets (in
`/tmp/vllm-patch-ipc-<id>` when the temp dir's path is too long for an
AF_UNIX socket address); a local Ray cluster this process starts keeps its
session in `/tmp/vllm-patch-ray-<id>` (short whatever TMPDIR is). The KV
storage, the sockets and Ray's session go at the end, the logs too unless
the deployment failed (then the last message says where).

Memory: on a CPU node vLLM reserves `--gpu-memory-utilization` (default
0.92) of the NUMA node's memory per server and refuses to start when less is
available. Instances that share a host get a share each (see
`memory_utilization`), like the cores; a server given
--gpu-memory-utilization, --kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE
keeps the user's setting. Progress is logged
(logger `vllm_patch.launch.deployment`); `vllm_patch.launch.show_progress()`
prints it, as the `launch` and `demo` commands do.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import secrets
import shutil
import signal
import stat
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

from vllm_patch.launch.config import ROLES, LaunchConfig, LaunchError
from vllm_patch.launch.supervisor import InstanceSupervisor, kv_folder, port_free

PLACE_TIMEOUT_S = 120.0
# A supervisor that has not answered a status poll within this many seconds
# is unreachable for that poll (see LaunchConfig.unreachable_grace_s).
STATUS_TIMEOUT_S = 30.0

# NixlConnector's kv_lease_duration (kv_connector_extra_config) when the user
# sets none: how long a prefill server keeps a finished prompt's KV blocks
# for a decode server that has not read them yet (vLLM 0.32/0.33 default 30 s;
# the decode side's heartbeats renew it once the request reaches the decode
# server, so only the trip there and a stuck decode node count). 120 s, as
# long as --unreachable-grace's default: a decode request held up by a
# partition of up to that long (TCP retransmits it when the link is back)
# still finds its blocks, and a decode node gone for good holds them at most
# 2 minutes. (vLLM's old VLLM_NIXL_ABORT_REQUEST_TIMEOUT is not read by 0.32.)
NIXL_KV_LEASE_S = 120

# vLLM's default --gpu-memory-utilization (CacheConfig.gpu_memory_utilization),
# on the CPU the fraction of the NUMA node's memory one server reserves.
VLLM_MEMORY_UTILIZATION = 0.92
# Of the memory available when the launcher looks, the part it hands out.
# The rest absorbs what the servers use beyond their share and what other
# processes allocate meanwhile; Ray's memory monitor kills the supervisor
# actors (and with them the servers) once the node passes 95 % of its memory
# (RAY_memory_usage_threshold): at 0.9 two tiny-model servers on a shared
# 24 GiB host were killed so.
MEMORY_HEADROOM = 0.7
# Below this per server, the launcher refuses to start (a vLLM CPU server's
# own process takes 1-2 GiB before weights and KV cache).
MIN_SERVER_MEMORY = 2 << 30
# vLLM flags / variables that set a server's memory itself.
MEMORY_FLAGS = ("--gpu-memory-utilization", "--device-memory-utilization",
                "--kv-cache-memory-bytes")

logger = logging.getLogger(__name__)

# Deployments of this process inside close() (see closing()).
_closing = 0


def closing() -> bool:
    """True while a deployment of this process is stopping: a stop signal
    then must not interrupt it (command.py's handler waits instead)."""
    return _closing > 0


@dataclasses.dataclass
class Instance:
    role: str
    index: int
    actor: Any
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    status: dict[str, Any] = dataclasses.field(default_factory=dict)
    # what its server was started with (a replacement gets the same)
    memory_args: list[str] = dataclasses.field(default_factory=list)
    bind: str | None = None
    # lost: when its supervisor died or its node stayed unreachable while
    # other instances of its role kept serving (None: not lost)
    lost_since: float | None = None
    # a replacement supervisor being placed: (actor, its node_info ref, when)
    pending: tuple[Any, Any, float] | None = None
    # started again, not healthy yet: the router does not send to it
    rejoining: bool = False

    @property
    def live(self) -> bool:
        return self.lost_since is None and not self.rejoining

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def url(self) -> str:
        return self.status["url"]


@dataclasses.dataclass
class _RoleDown:
    """A role whose last instance was lost: since when, the error to raise
    after LaunchConfig.recovery_timeout_s, and the last progress note."""
    since: float
    fatal: LaunchError
    noted: float


def cpu_bind_ranges(cpus: list[int], n: int) -> list[str] | None:
    """Disjoint contiguous core ranges for n instances on one host, or None
    when that is impossible (fewer cores than instances, holes)."""
    if n > len(cpus):
        return None
    out = []
    for j in range(n):
        chunk = cpus[j * len(cpus) // n:(j + 1) * len(cpus) // n]
        if chunk != list(range(chunk[0], chunk[-1] + 1)):
            return None
        out.append(str(chunk[0]) if len(chunk) == 1 else f"{chunk[0]}-{chunk[-1]}")
    return out


def memory_utilization(total: int, available: int, n: int) -> float | None:
    """The --gpu-memory-utilization for each of `n` vLLM servers that share
    a NUMA node with `total` bytes, `available` free: vLLM's default budget
    (0.92 x total), capped at 70 % of what is available, split evenly.
    None when vLLM's default already fits (one server, enough available).

    vLLM's CPU worker reserves utilization x total and checks it against the
    memory available when it starts (0.32: "Available memory on node 0 ...
    is less than desired CPU memory utilization"; 0.32 and 0.33: again
    before allocating the KV cache), so a server that starts after another
    has allocated its share still finds its own: with the cap, the n-th
    sees at least available x (1 - 0.7 (n-1)/n) > its 0.7 x available / n."""
    if n == 1 and VLLM_MEMORY_UTILIZATION * total <= available:
        return None
    budget = min(VLLM_MEMORY_UTILIZATION * total, MEMORY_HEADROOM * available)
    return math.floor(budget / n / total * 1000 + 1e-6) / 1000


def own_memory_setting(args: list[str], env: dict[str, str]) -> str | None:
    """The flag or variable with which the user set a server's memory."""
    for a in args:
        flag = a.split("=", 1)[0]
        if flag in MEMORY_FLAGS:
            return flag
    if env.get("VLLM_CPU_KVCACHE_SPACE", "").strip():
        return "VLLM_CPU_KVCACHE_SPACE"
    return None


class Deployment:
    def __init__(self, cfg: LaunchConfig,
                 progress: Callable[[str], None] | None = None) -> None:
        """`progress`, if given, also receives each progress line as logged
        (tests collect them)."""
        self.cfg = cfg
        self.progress = progress
        self.instances: list[Instance] = []
        self.router: Any = None
        self._owns_ray = False
        self._connected = False
        self._t0 = time.monotonic()
        self._closed = False
        self._failed = False
        # Names this deployment's folder on every node.
        self.id = secrets.token_hex(4)
        self._ray_dir: str | None = None
        self._kv_storage: str | None = None
        # Ray's auth variables before this deployment set its own token
        self._ray_env: dict[str, str | None] | None = None
        self._created_token = False
        # instance name -> when its supervisor stopped answering
        self._unreachable_since: dict[str, float] = {}
        # role -> since when none of its instances serves
        self._role_down: dict[str, _RoleDown] = {}
        # how long one poll waits for the supervisors' answers
        self.status_timeout_s = STATUS_TIMEOUT_S

    # ---- public --------------------------------------------------------
    @property
    def url(self) -> str:
        if self.router is None:
            raise LaunchError("the deployment is not running")
        return self.router.url

    def role_instances(self, role: str) -> list[Instance]:
        """The role's instances that serve (not lost, not rejoining)."""
        return [i for i in self.instances if i.role == role and i.live]

    def metrics(self, role: str) -> dict[str, float]:
        """Prometheus metrics of a role, summed over its instances."""
        from vllm_patch.launch.router import parse_metrics

        total: dict[str, float] = {}
        for inst in self.role_instances(role):
            with urllib.request.urlopen(inst.url + "/metrics", timeout=10) as r:
                for k, v in parse_metrics(r.read().decode()).items():
                    total[k] = total.get(k, 0.0) + v
        return total

    def __enter__(self) -> "Deployment":
        try:
            self.start()
        except BaseException as e:
            self.close(failed=not isinstance(e, (KeyboardInterrupt, SystemExit)))
            raise
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        # a stop asked for (Ctrl-C, SIGTERM) is not a failure: no logs kept
        self.close(failed=exc_type is not None
                   and not issubclass(exc_type, (KeyboardInterrupt, SystemExit)))

    def start(self) -> None:
        cfg = self.cfg
        if cfg.router.port and not port_free(cfg.router.host, cfg.router.port):
            raise LaunchError(f"router port {cfg.router.host}:{cfg.router.port} "
                              "is already in use")
        self._connect()
        self._place()
        self._start_servers()
        self.wait_ready()
        from vllm_patch.launch.router import ProxyThread

        try:
            self.router = ProxyThread([i.url for i in self.role_instances("prefill")],
                                      [i.url for i in self.role_instances("decode")],
                                      host=cfg.router.host, port=cfg.router.port or None)
        except RuntimeError as e:  # the port was taken while the servers started
            raise LaunchError(str(e)) from None
        self._say(f"ready: router {self.router.url} -> prefill "
                  f"{[i.url for i in self.role_instances('prefill')]}, decode "
                  f"{[i.url for i in self.role_instances('decode')]}")

    # ---- steps ---------------------------------------------------------
    def _say(self, msg: str, level: int = logging.INFO) -> None:
        line = f"[{time.monotonic() - self._t0:5.0f}s] {msg}"
        logger.log(level, "%s", line)
        if self.progress is not None:
            self.progress(line)

    def _connect(self) -> None:
        try:
            import ray
        except ImportError:
            raise LaunchError("Ray is not installed: pip install 'vllm-patch[launch]' "
                              "(or ray>=2.50)") from None

        address = self.cfg.address or os.environ.get("RAY_ADDRESS")
        handlers = _signal_handlers()  # ray.init sets its own SIGTERM handler
        if ray.is_initialized():
            self._say("using the Ray connection of this process")
        elif address:
            self._say(f"connecting to Ray at {address}")
            try:
                ray.init(address=address, log_to_driver=False)
            except Exception as e:  # noqa: BLE001 - say why, no traceback
                ray.shutdown()
                hint = ""
                if "authentication" in f"{type(e).__name__} {e}".lower():
                    hint = (" (the cluster and this command must agree on Ray's token "
                            "authentication: with a token file, `ray start --head` turns "
                            "it on while a client given an address does not; set "
                            "RAY_AUTH_MODE=token here, with the cluster's token in "
                            "~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH, or "
                            "start the cluster with RAY_AUTH_MODE=disabled)")
                raise LaunchError(f"could not connect to the Ray cluster at {address}: "
                                  f"{type(e).__name__}: {_ray_error_line(e)}{hint}"
                                  ) from None
            self._connected = True
        else:
            # its session folder in a short folder of its own, not /tmp/ray
            # nor under TMPDIR: Ray's socket paths must fit in 107 bytes
            self._ray_dir = ray_folder(self.id)
            self._say(f"starting a local Ray cluster (its files in {self._ray_dir})")
            # Ray (2.60) turns token authentication on for a new local cluster
            # and would write its token to ~/.ray/auth_token, where it stays
            # (and turns tokens on for later `ray start --head` clusters):
            # this cluster's token goes in its own folder instead
            self._ray_env = own_ray_token(self._ray_dir)
            token_existed = RAY_DEFAULT_TOKEN.exists()
            try:
                # "local": a new cluster, never a running one found on this host
                ray.init(address="local", include_dashboard=False, log_to_driver=False,
                         _temp_dir=self._ray_dir)
            except Exception as e:  # noqa: BLE001 - Ray's start failed: say why
                ray.shutdown()
                raise LaunchError(f"could not start a local Ray cluster: "
                                  f"{type(e).__name__}: {_ray_error_line(e)}") from None
            finally:
                if not token_existed and RAY_DEFAULT_TOKEN.exists():
                    self._created_token = True  # by this start: removed at close
            self._connected = self._owns_ray = True
        _restore_signal_handlers(handlers)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        self._gpu_nodes = {n["NodeID"] for n in nodes if n["Resources"].get("GPU", 0) > 0}
        resources = ray.cluster_resources()
        custom = sorted(k for k in resources
                        if k not in ("CPU", "GPU", "memory", "object_store_memory")
                        and not k.startswith(("node:", "accelerator_type:")))
        for role in ROLES:
            labels = self.cfg.role(role).node_labels
            if labels and not any(labels.items() <= (n.get("Labels") or {}).items()
                                  for n in nodes):
                raise LaunchError(
                    f"no node of the Ray cluster carries the labels {labels} asked for "
                    f"{role} (start the nodes with `ray start --labels "
                    f"'{json.dumps(labels)}'`)")
            r = self.cfg.role(role).node_resource
            if r is not None and r not in resources:
                raise LaunchError(
                    f"unknown node resource {r!r} for {role}: no node of the Ray cluster "
                    f"offers it (custom resources there: {custom or 'none'}); start the "
                    f"nodes with `ray start --resources '{{\"{r}\": 1}}'`")
        self._say(f"Ray: {len(nodes)} node(s), custom resources {custom or 'none'}")

    def _place(self) -> None:
        import ray

        for role in ROLES:
            rc = self.cfg.role(role)
            for i in range(rc.count):
                actor = self._new_actor(role, i, "SPREAD")
                self.instances.append(Instance(role, i, actor))
        refs = [i.actor.node_info.remote() for i in self.instances]
        try:
            infos = ray.get(refs, timeout=PLACE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise LaunchError(
                f"could not place every instance within {PLACE_TIMEOUT_S:.0f} s "
                "(not enough nodes with the requested resources?)") from None
        for inst, info in zip(self.instances, infos):
            inst.info = info
            self._say(f"{inst.name} placed on node {info['ip']} "
                      f"({(info['node_id'] or '?')[:12]})")

    def _new_actor(self, role: str, index: int, strategy: Any) -> Any:
        """A supervisor actor for instance `index` of `role` on a node with
        the role's resources and labels; `strategy`: Ray's scheduling
        strategy ("SPREAD": the role's instances on different nodes where
        there are several)."""
        import ray

        rc = self.cfg.role(role)
        opts: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0, "max_concurrency": 4,
                                "scheduling_strategy": strategy}
        if rc.node_resource:
            opts["resources"] = {rc.node_resource: 0.001}
        if rc.node_labels:
            opts["label_selector"] = dict(rc.node_labels)
        return ray.remote(InstanceSupervisor).options(**opts).remote(
            f"{role}-{index}", self.cfg.max_restarts, self.cfg.log_dir,
            deployment_id=self.id)

    def _env(self, inst: Instance, side_channel_port: int, bind: str | None) -> dict[str, str]:
        rc = self.cfg.role(inst.role)
        env = {**self.cfg.env, **rc.env}
        env.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", inst.info["ip"])
        env.setdefault("VLLM_NIXL_SIDE_CHANNEL_PORT", str(side_channel_port))
        # vLLM's ZMQ IPC sockets: in the deployment's folder, not the temp dir
        env.setdefault("VLLM_RPC_BASE_PATH", inst.info["ipc_dir"])
        if bind is not None:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
        return env

    def _binds(self) -> dict[str, str | None]:
        """VLLM_CPU_OMP_THREADS_BIND per instance (CPU nodes only)."""
        binds: dict[str, str | None] = {i.name: None for i in self.instances}
        by_host: dict[str, list[Instance]] = {}
        for inst in self.instances:
            if inst.info["node_id"] in self._gpu_nodes:
                continue
            mode = self.cfg.role(inst.role).cpu_bind
            if mode == "off":
                continue
            if mode != "auto":
                binds[inst.name] = mode
                continue
            by_host.setdefault(inst.info["ip"], []).append(inst)
        for host, insts in by_host.items():
            ranges = cpu_bind_ranges(insts[0].info["cpus"], len(insts))
            if ranges is None:
                self._say(f"{len(insts)} instances share the {len(insts[0].info['cpus'])} "
                          f"core(s) of {host}: no thread binding")
                continue
            for inst, r in zip(insts, ranges):
                binds[inst.name] = r
            if len(insts) > 1 and self.cfg.connector == "NixlConnector":
                off = [i.name for i in insts if not self._nixl_core_fix_on(i)]
                if off:
                    self._say(
                        f"{len(insts)} NixlConnector instances on {host}, the NIXL "
                        f"transfer-core fix is off for {', '.join(off)} "
                        "(VLLM_PATCH_DISABLE=1 or VLLM_PATCH_NIXL_CPU_CORE_IN_BIND=0): "
                        "vLLM's NIXL CPU worker moves each one's main thread to the "
                        "host's last core whatever VLLM_CPU_OMP_THREADS_BIND says, "
                        "where one instance's busy worker starves the other; "
                        "VLLM_PATCH_NIXL_CPU_CORE_IN_BIND=1 keeps each within its "
                        "own cores", logging.WARNING)
        return binds

    def _server_env(self, inst: Instance) -> dict[str, str]:
        """The variables a server gets that the launcher can see (its own
        environment stands in for the node's)."""
        rc = self.cfg.role(inst.role)
        return {**os.environ, **self.cfg.env, **rc.env}

    def _nixl_core_fix_on(self, inst: Instance) -> bool:
        from vllm_patch import envs
        from vllm_patch.series import native_patch_ids

        if "cpu-nixl-kv-core-in-bind" in native_patch_ids():
            # A patched vLLM build keeps the core within the binding itself
            # (the vLLM installed here, which the nodes run too).
            return True
        env = self._server_env(inst)
        own = env.get("VLLM_PATCH_NIXL_CPU_CORE_IN_BIND", "").strip().lower()
        if own:
            return own in envs._TRUE
        return env.get("VLLM_PATCH_DISABLE", "0").strip().lower() not in envs._TRUE

    def _memory_args(self) -> dict[str, list[str]]:
        """--gpu-memory-utilization per server that shares a CPU host with
        others (or whose host has less available than vLLM's default needs)
        and has no memory setting of its own; LaunchError when the share
        would be too small to start a server."""
        args: dict[str, list[str]] = {i.name: [] for i in self.instances}
        by_host: dict[str, list[Instance]] = {}
        for inst in self.instances:
            if inst.info["node_id"] not in self._gpu_nodes:
                by_host.setdefault(inst.info["ip"], []).append(inst)
        for host, insts in by_host.items():
            own = {}
            for inst in insts:
                rc = self.cfg.role(inst.role)
                env = {**self.cfg.env, **rc.env}
                if inst.info.get("kvcache_env"):
                    env.setdefault("VLLM_CPU_KVCACHE_SPACE", inst.info["kvcache_env"])
                setting = own_memory_setting([*self.cfg.vllm_args, *rc.vllm_args], env)
                if setting:
                    own[inst.name] = setting
            rest = [i for i in insts if i.name not in own]
            if not rest:
                continue
            mem = insts[0].info["memory"]
            util = memory_utilization(mem["total"], mem["available"], len(insts))
            if util is None:
                continue
            gib = lambda b: f"{b / (1 << 30):.1f}"  # noqa: E731
            share = int(util * mem["total"])
            if share < MIN_SERVER_MEMORY:
                raise LaunchError(
                    f"{len(insts)} vLLM server(s) on {host} would get "
                    f"{gib(share)} GiB of memory each ({gib(mem['available'])} of "
                    f"{gib(mem['total'])} GiB available on NUMA node {mem['node']}), "
                    f"less than the {gib(MIN_SERVER_MEMORY)} GiB a server needs to "
                    "start: free memory, place fewer instances on that host, or set "
                    "each server's memory yourself with --kv-cache-memory-bytes "
                    "(or --gpu-memory-utilization) after `--`")
            for inst in rest:
                args[inst.name] = ["--gpu-memory-utilization", f"{util:g}"]
            kept = f"; kept their own setting: {', '.join(f'{n} ({f})' for n, f in own.items())}" \
                if own else ""
            self._say(
                f"memory on {host}: {gib(mem['available'])} of {gib(mem['total'])} GiB "
                f"available, {len(insts)} server(s): {', '.join(i.name for i in rest)} "
                f"get --gpu-memory-utilization {util:g} ({gib(share)} GiB each, weights "
                f"and KV cache){kept}; set --gpu-memory-utilization or "
                "--kv-cache-memory-bytes after `--` to choose")
        return args

    def _kv_config(self, inst: Instance) -> dict[str, Any]:
        cfg = self.cfg
        extra = dict(cfg.kv_connector_extra_config)
        if self._kv_storage is not None:
            extra["shared_storage_path"] = self._kv_storage
        kv: dict[str, Any] = {
            "kv_connector": cfg.connector,
            "kv_role": "kv_producer" if inst.role == "prefill" else "kv_consumer",
            "kv_connector_extra_config": extra,
            **cfg.kv_transfer_config}
        if cfg.connector == "NixlConnector":
            extra.setdefault("kv_lease_duration", NIXL_KV_LEASE_S)
            if inst.info["node_id"] not in self._gpu_nodes:
                kv.setdefault("kv_buffer_device", "cpu")
        return kv

    def _start_servers(self) -> None:
        import ray

        cfg = self.cfg
        binds = self._binds()
        memory = self._memory_args()
        if cfg.connector == "ExampleConnector":
            user_path = cfg.kv_connector_extra_config.get("shared_storage_path")
            if user_path:
                # a folder of this deployment's own in the user's: removed
                # at the end with every KV file in it, the user's files stay
                self._kv_storage = kv_folder(str(user_path), self.id)
            else:
                # vLLM's default is the temp dir itself; ours goes with the
                # deployment (one host; across hosts set a shared path)
                self._kv_storage = os.path.join(self.role_instances("prefill")[0]
                                                .info["tmp_dir"], "kv")
        prepared = []
        for inst in self.instances:
            rc = cfg.role(inst.role)
            port = None if rc.port is None else rc.port + inst.index
            prepared.append(inst.actor.prepare.remote(cfg.model, port,
                                                      {**cfg.env, **rc.env},
                                                      self._kv_storage))
        ports, errors = [], []
        for ref in prepared:  # every instance's answer, so all problems are listed
            try:
                ports.append(ray.get(ref, timeout=60))
            except ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None)
                if not isinstance(cause, LaunchError):
                    raise
                errors.append(str(cause))
        if errors:
            raise LaunchError("\n".join(errors))
        if self._kv_storage is not None:
            self._say(f"KV cache files (ExampleConnector) in {self._kv_storage}, this "
                      "deployment's own folder, removed when it stops")
        if cfg.connector == "NixlConnector":
            lease = cfg.kv_connector_extra_config.get("kv_lease_duration", NIXL_KV_LEASE_S)
            self._say(f"NIXL KV lease: a prefill server frees a prompt's KV blocks "
                      f"{lease} s after its prefill if no decode server has read them "
                      "(kv_lease_duration in --kv-connector-extra-config)")
            if any("VLLM_NIXL_ABORT_REQUEST_TIMEOUT" in self._server_env(i)
                   for i in self.instances):
                self._say("VLLM_NIXL_ABORT_REQUEST_TIMEOUT is set but this vLLM does not "
                          "read it: set kv_lease_duration in --kv-connector-extra-config "
                          "instead", logging.WARNING)
        started = []
        for inst, p in zip(self.instances, ports):
            inst.memory_args, inst.bind = memory[inst.name], binds[inst.name]
            started.append(self._start_server(inst, p))
        for inst, st in zip(self.instances, ray.get(started, timeout=60)):
            inst.status = st
            bind = binds[inst.name]
            self._say(f"{inst.name} starting: {st['url']} pid {st['pid']}"
                      + (f", cores {bind}" if bind else "") + f", log {st['log']}")

    def _start_server(self, inst: Instance, ports: dict[str, int]) -> Any:
        """Its supervisor's start() call (a Ray ref)."""
        cfg = self.cfg
        rc = cfg.role(inst.role)
        cmd = [*cfg.server_command, "--host", inst.info["ip"], "--port",
               str(ports["port"]), "--model", cfg.model]
        if cfg.served_model_name:
            cmd += ["--served-model-name", cfg.served_model_name]
        cmd += ["--kv-transfer-config", json.dumps(self._kv_config(inst)),
                *inst.memory_args, *cfg.vllm_args, *rc.vllm_args]
        env = self._env(inst, ports["side_channel_port"], inst.bind)
        return inst.actor.start.remote(cmd, env, ports["port"])

    def poll(self) -> list[dict[str, Any]]:
        """Current status of every instance; LaunchError if one has failed,
        its supervisor actor is dead, or it has been unreachable for longer
        than `unreachable_grace_s` (until then its last status is returned
        with state "unreachable")."""
        import ray

        for inst in self.instances:
            if inst.lost_since is not None:
                self._replace(inst)
        self._check_role_down()
        polled = [i for i in self.instances if i.lost_since is None]
        refs = [i.actor.status.remote() for i in polled]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.status_timeout_s)
        answered = set(ready)
        sts: list[dict[str, Any]] = []
        for inst, ref in zip(polled, refs):
            if ref not in answered:
                sts.append(self._unreachable(inst, f"no answer within "
                                             f"{self.status_timeout_s:g} s"))
                continue
            try:
                st = ray.get(ref, timeout=0)
            except ray.exceptions.OutOfMemoryError as e:
                raise LaunchError(
                    "Ray's memory monitor killed the supervisor actors, and their "
                    f"servers with them: {str(e).splitlines()[0]} (give the servers "
                    "less memory: --gpu-memory-utilization or --kv-cache-memory-bytes "
                    "after `--`)") from None
            except (ray.exceptions.ActorUnavailableError,
                    ray.exceptions.GetTimeoutError) as e:
                sts.append(self._unreachable(inst, _ray_error_line(e)))
                continue
            except ray.exceptions.RayError as e:
                why = (f"its supervisor actor died (its server was signalled to stop): "
                       f"{_ray_error_line(e)}")
                self._lose(inst, why, LaunchError(f"{inst.name}: {why}"))
                sts.append(self._lost_status(inst))
                continue
            since = self._unreachable_since.pop(inst.name, None)
            if since is not None:
                self._say(f"{inst.name} on node {inst.info.get('ip', '?')} reachable "
                          f"again after {time.monotonic() - since:.0f} s")
            sts.append(st)
        for inst, st in zip(polled, sts):
            if st["state"] in ("unreachable", "lost"):
                continue
            prev = inst.status
            inst.status = st
            if st["state"] == "failed":
                tail = ray.get(inst.actor.log_tail.remote(), timeout=30)
                raise LaunchError(f"{st['error']}\nlast lines of {st['log']} on "
                                  f"{st['host']}:\n{tail}")
            if st["spawns"] > prev.get("spawns", st["spawns"]):
                self._say(f"{inst.name} exited (code {st['exits'][-1]}: "
                          f"{st['causes'][-1]}); restarted ({st['restarts']}/"
                          f"{self.cfg.max_restarts}) as pid {st['pid']}")
            if st["state"] != prev.get("state") and st["state"] == "healthy":
                self._say(f"{inst.name} healthy at {st['url']}")
                if inst.rejoining:
                    inst.rejoining = False
                    self._update_router()
                    down = self._role_down.pop(inst.role, None)
                    if down is not None:
                        self._say(f"{inst.role} serves again after "
                                  f"{time.monotonic() - down.since:.0f} s without an instance")
                    self._say(f"{inst.name} rejoined: the router sends {inst.role} "
                              f"requests to {', '.join(i.name for i in self.role_instances(inst.role))}")
        return sts + [self._lost_status(i) for i in self.instances
                      if i.lost_since is not None and i not in polled]

    def _lost_status(self, inst: Instance) -> dict[str, Any]:
        return {**inst.status, "name": inst.name, "state": "lost"}

    def _lose(self, inst: Instance, why: str, fatal: LaunchError) -> None:
        """An instance whose supervisor died or whose node stayed
        unreachable: when other instances of its role serve, the deployment
        goes on with them (the router no longer sends to it) and a new
        supervisor is placed for it on a node of its role that has none
        (see _replace). When it was its role's last, the router answers
        that role's requests with 503 while the launcher waits for a node
        to start it on; `fatal` is raised when none serves within
        LaunchConfig.recovery_timeout_s (at once when that is 0)."""
        import ray

        where = f"{inst.name} on node {inst.info.get('ip', '?')}"
        others = [i for i in self.role_instances(inst.role) if i is not inst]
        timeout = self.cfg.recovery_timeout_s
        if not others and timeout <= 0:
            raise fatal
        inst.lost_since = time.monotonic()
        inst.rejoining = False
        self._unreachable_since.pop(inst.name, None)
        try:
            ray.kill(inst.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self._update_router()
        if others:
            self._say(f"{where} lost: {why}. The deployment keeps serving: {inst.role} "
                      f"requests go to {', '.join(i.name for i in others)}; {inst.name} is "
                      f"started again once a node for {inst.role} without one is in the "
                      "cluster (its node back, or another)", logging.WARNING)
            return
        if inst.role not in self._role_down:
            self._role_down[inst.role] = _RoleDown(inst.lost_since, fatal, inst.lost_since)
        self._say(f"{where} lost: {why}. No {inst.role} instance serves now: requests get "
                  f"a 503 until {inst.name} is started again on a node for {inst.role} "
                  f"(its node back in the Ray cluster, or another); the deployment stops "
                  f"if none serves within {timeout:g} s (--recovery-timeout)",
                  logging.WARNING)

    def _check_role_down(self) -> None:
        """A role without a serving instance: a note every 30 s, and
        LaunchError once LaunchConfig.recovery_timeout_s has passed."""
        now = time.monotonic()
        timeout = self.cfg.recovery_timeout_s
        for role, down in self._role_down.items():
            since = down.since
            if now - since > timeout:
                raise LaunchError(f"no {role} instance has served for {timeout:g} s "
                                  f"(--recovery-timeout): {down.fatal}")
            if now - down.noted >= 30:
                down.noted = now
                waiting = [i for i in self.instances if i.role == role]
                what = ("starting" if any(i.pending or i.rejoining for i in waiting)
                        else f"waiting for a node for {role} in the Ray cluster")
                self._say(f"still no {role} instance ({now - since:.0f} s of "
                          f"{timeout:g}): {what}", logging.WARNING)

    def _update_router(self) -> None:
        if self.router is not None:
            self.router.set_instances([i.url for i in self.role_instances("prefill")],
                                      [i.url for i in self.role_instances("decode")],
                                      [i.url for i in self.instances if not i.live])

    def _free_node(self, inst: Instance) -> str | None:
        """A node for a lost instance: an alive node with its role's
        resource and labels where no serving instance of the role runs
        (the role's instances stay on different nodes, as placed), else
        its own node if that is still in the cluster (its supervisor alone
        died: a host with several instances of the role)."""
        import ray

        role = inst.role
        rc = self.cfg.role(role)
        taken = {i.info.get("node_id") for i in self.instances
                 if i.role == role and i.lost_since is None}
        fits = [n["NodeID"] for n in ray.nodes() if n.get("Alive")
                and (not rc.node_resource or n["Resources"].get(rc.node_resource, 0) > 0)
                and (not rc.node_labels
                     or rc.node_labels.items() <= (n.get("Labels") or {}).items())]
        free = [n for n in fits if n not in taken]
        if free:
            return free[0]
        # its own node, still in the cluster (only its supervisor died)
        own = inst.info.get("node_id")
        return own if own in fits else None

    def _replace(self, inst: Instance) -> None:
        """One step of starting a lost instance again: place a new
        supervisor on a free node of its role, then (once it answers)
        start its server there with the same arguments; the router takes
        it back once it is healthy (poll)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if inst.pending is None:
            node = self._free_node(inst)
            if node is None:
                return
            actor = self._new_actor(inst.role, inst.index,
                                    NodeAffinitySchedulingStrategy(node, soft=False))
            inst.pending = (actor, actor.node_info.remote(), time.monotonic())
            self._say(f"{inst.name}: a node for {inst.role} is available "
                      f"({node[:12]}); starting its supervisor there")
            return
        actor, ref, t0 = inst.pending
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            if time.monotonic() - t0 > PLACE_TIMEOUT_S:
                ray.kill(actor, no_restart=True)
                inst.pending = None
            return
        inst.pending = None
        try:
            info = ray.get(ref, timeout=0)
            rc = self.cfg.role(inst.role)
            port = None if rc.port is None else rc.port + inst.index
            ports = ray.get(actor.prepare.remote(self.cfg.model, port,
                                                 {**self.cfg.env, **rc.env},
                                                 self._kv_storage), timeout=60)
            old_info, inst.info, inst.actor = inst.info, info, actor
            st = ray.get(self._start_server(inst, ports), timeout=60)
        except Exception as e:  # noqa: BLE001 - the node went again: try later
            self._say(f"{inst.name}: could not start it again ({type(e).__name__}: "
                      f"{_ray_error_line(e)}); trying again", logging.WARNING)
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
            return
        inst.status, inst.lost_since, inst.rejoining = st, None, True
        self._say(f"{inst.name} started again on node {info['ip']} (was "
                  f"{old_info.get('ip', '?')}): {st['url']} pid {st['pid']}, log "
                  f"{st['log']}; the router sends to it once it is healthy")

    def _unreachable(self, inst: Instance, why: str) -> dict[str, Any]:
        """A transient failure to reach an instance's supervisor: its last
        status marked "unreachable" while within the grace period, else
        LaunchError."""
        now = time.monotonic()
        since = self._unreachable_since.setdefault(inst.name, now)
        grace = self.cfg.unreachable_grace_s
        where = f"{inst.name} on node {inst.info.get('ip', '?')}"
        if now - since > grace:
            why = f"unreachable for more than {grace:g} s (--unreachable-grace): {why}"
            self._lose(inst, why, LaunchError(f"{where} {why}"))
            return self._lost_status(inst)
        if since == now:
            self._say(f"{where} unreachable ({why}); polling it again for up to "
                      f"{grace:g} s", logging.WARNING)
        return {**inst.status, "name": inst.name, "state": "unreachable"}

    def wait_ready(self, timeout_s: float | None = None) -> None:
        timeout_s = timeout_s or self.cfg.start_timeout_s
        deadline = time.monotonic() + timeout_s
        last_report = time.monotonic()
        while True:
            sts = self.poll()
            waiting = [s["name"] for s in sts if s["state"] not in ("healthy", "lost")]
            if not waiting:
                return
            if time.monotonic() > deadline:
                import ray

                inst = next(i for i in self.instances if i.name == waiting[0])
                tail = ray.get(inst.actor.log_tail.remote(), timeout=30)
                raise LaunchError(f"not healthy after {timeout_s:.0f} s: {waiting}; last "
                                  f"lines of {inst.status['log']}:\n{tail}")
            if time.monotonic() - last_report >= 10:
                self._say(f"waiting for {', '.join(waiting)} (a vLLM server takes 1-3 "
                          "min to start on a CPU, more on a busy host)")
                last_report = time.monotonic()
            time.sleep(1.0)

    def serve_forever(self, poll_s: float = 2.0, until: Callable[[], bool] | None = None) -> None:
        """Watch the instances (their supervisors restart them); return when
        `until()` is true, raise LaunchError when one has failed for good."""
        while until is None or not until():
            self.poll()
            time.sleep(poll_s)

    def close(self, failed: bool = False) -> None:
        """Stop everything; remove the deployment's files (the KV storage
        always, logs unless `failed` or a log_dir was given)."""
        global _closing
        if self._closed:
            return
        self._closed = True
        self._failed = failed
        _closing += 1
        try:
            self._close(failed)
        finally:
            _closing -= 1

    def _close(self, failed: bool) -> None:
        if self.router is not None:
            self.router.stop()
        kept: list[str] = []
        if self.instances:
            import ray

            for inst in self.instances:  # a replacement still being placed
                if inst.pending is not None:
                    ray.kill(inst.pending[0], no_restart=True)
                    inst.pending = None
            self._say(f"stopping {len(self.instances)} instance(s)")
            refs = [i.actor.stop.remote() for i in self.instances]
            for inst, ref in zip(self.instances, refs):
                try:
                    ray.get(ref, timeout=60)
                except Exception as e:  # the actor is gone: PDEATHSIG took the server
                    self._say(f"{inst.name}: stop failed ({type(e).__name__}); its "
                              "server dies with its actor", logging.WARNING)
            # nodes where the KV folder may remain: supervisor gone, or stuck
            kv_gone: list[str] = []
            kv_stuck: list[str] = []
            for inst in self.instances:  # one by one: the last removes the folder
                try:
                    done = ray.get(inst.actor.cleanup.remote(failed), timeout=30)
                    if done["log"]:
                        kept.append(done["log"])
                    if done["kv_dir"]:
                        kv_stuck.append(inst.info.get("ip", "?"))
                except Exception:  # noqa: BLE001 - the actor is gone
                    if inst.info:
                        kv_gone.append(inst.info.get("ip", "?"))
                ray.kill(inst.actor, no_restart=True)
            if self._kv_storage is not None:
                self._remove_kv_storage(kv_gone, kv_stuck)
        if self._connected:
            import ray

            ray.shutdown()
        if self._ray_dir is not None:
            self._remove_ray_dir()
        if self._created_token:
            RAY_DEFAULT_TOKEN.unlink(missing_ok=True)
            try:
                RAY_DEFAULT_TOKEN.parent.rmdir()  # only when empty
            except OSError:
                pass
        if self._ray_env is not None:
            for k, v in self._ray_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self._remove_local_folder()
        if kept:
            self._say(f"logs kept: {', '.join(kept)}")
        self._say("stopped" + (" (local Ray cluster shut down)" if self._owns_ray else ""))

    def _remove_kv_storage(self, gone: list[str], stuck: list[str]) -> None:
        """ExampleConnector's KV folder as this host sees it (each node's
        supervisor removed its own; this covers a folder this host shares
        with a node whose supervisor is `gone`), and a warning naming the
        nodes where it may remain (`stuck`: the supervisor could not remove
        it)."""
        assert self._kv_storage is not None
        path = self._kv_storage
        here = os.path.isdir(path) and not os.path.islink(path)
        if here:
            shutil.rmtree(path, ignore_errors=True)
            parent = os.path.dirname(path)
            if os.path.basename(parent) == f"vllm-patch-launch-{self.id}":
                try:
                    os.rmdir(parent)  # only when empty
                except OSError:
                    pass
        if os.path.exists(path):
            self._say(f"could not remove the KV cache folder {path} on this host: "
                      "remove it by hand", logging.WARNING)
        elif stuck:
            self._say(f"could not remove the KV cache folder {path} on node(s) "
                      f"{', '.join(sorted(set(stuck)))}: remove it there by hand",
                      logging.WARNING)
        if gone:
            self._say(f"the KV cache folder {path} may remain on node(s) "
                      f"{', '.join(sorted(set(gone)))}, whose supervisor was gone at the "
                      "stop" + (" (removed on this host, so there too if the folder "
                                "is shared)" if here else "")
                      + ": remove it there if it does", logging.WARNING)

    def _remove_local_folder(self) -> None:
        """This host's deployment folder, when supervisors that died could
        not clean it: vLLM's sockets go, the folder too once empty (logs of
        a failed deployment stay)."""
        folder = os.path.join(tempfile.gettempdir(), f"vllm-patch-launch-{self.id}")
        if not os.path.isdir(folder):
            return
        for entry in os.scandir(folder):
            if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                try:
                    os.unlink(entry.path)
                except OSError:
                    pass
        try:
            os.rmdir(folder)
        except OSError:
            pass

    def _remove_ray_dir(self) -> None:
        """The local Ray cluster's session folder, once its processes are
        gone (the servers' logs hold the causes of a failure, not Ray's)."""
        assert self._ray_dir is not None
        remove_ray_folder(self._ray_dir)


RAY_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
# Where Ray looks for (and a new local cluster writes) its token by default.
RAY_DEFAULT_TOKEN = Path.home() / ".ray" / "auth_token"


def own_ray_token(folder: str) -> dict[str, str | None] | None:
    """A new local Ray cluster's token in `folder`/ray-auth-token
    (RAY_AUTH_TOKEN_PATH, read by this process and the Ray processes and
    actors it starts), so Ray does not write ~/.ray/auth_token. Returns Ray's
    auth variables as they were, to restore when the cluster is gone; None
    (nothing done) when the user configured a mode or token."""
    if any(os.environ.get(k) for k in RAY_AUTH_VARS):
        return None
    saved = {k: os.environ.get(k) for k in RAY_AUTH_VARS}
    path = os.path.join(folder, "ray-auth-token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.environ["RAY_AUTH_TOKEN_PATH"] = path
    return saved


# Ray's longest socket path below its temp dir:
# /session_2026-12-03_05-57-09_123456_1234567/sockets/plasma_store
RAY_SOCKET_SUFFIX_LEN = 64


def ray_folder(deployment_id: str) -> str:
    """A new folder for a local Ray cluster's files, short enough for Ray's
    AF_UNIX socket paths (at most 107 bytes) whatever TMPDIR is: under /tmp,
    else under the temp dir if that is short; LaunchError (before anything
    starts) when neither is possible."""
    from vllm_patch.launch.supervisor import SOCKET_PATH_MAX

    name = f"vllm-patch-ray-{deployment_id}"
    tried = []
    for parent in dict.fromkeys(("/tmp", tempfile.gettempdir())):
        path = os.path.join(parent, name)
        if len(os.fsencode(path)) + RAY_SOCKET_SUFFIX_LEN > SOCKET_PATH_MAX:
            tried.append(f"{parent}: too long")
            continue
        try:
            os.mkdir(path, 0o700)
            return path
        except OSError as e:
            tried.append(f"{parent}: {e.strerror}")
    raise LaunchError(
        "no folder for the local Ray cluster's files: Ray's AF_UNIX socket paths "
        f"(at most {SOCKET_PATH_MAX} bytes) need a short, writable folder "
        f"({'; '.join(tried)}); make /tmp writable, set TMPDIR to a short folder, "
        "or start Ray yourself and pass --address")


def _ray_error_line(e: BaseException) -> str:
    """The first line of a Ray error's message (of its cause when it was
    raised in a task), without terminal colours."""
    import re

    cause = getattr(e, "cause", None)
    text = str(cause if isinstance(cause, BaseException) else e)
    return re.sub(r"\x1b\[[0-9;]*m", "", text).strip().splitlines()[0] if text.strip() \
        else type(e).__name__


def remove_ray_folder(path: str) -> None:
    """A stopped local Ray cluster's temp folder (raylet and GCS may still
    write their last lines as they exit)."""
    for _ in range(20):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return
        time.sleep(0.5)


def _signal_handlers() -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}


def _restore_signal_handlers(saved: dict[int, Any]) -> None:
    for sig, handler in saved.items():
        if handler is not None:
            signal.signal(sig, handler)
