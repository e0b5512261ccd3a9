"""Three "nodes" on one host, each a Linux network namespace with its own
address on a bridge in the root namespace (198.18.0.0/24, a range set aside
for benchmarks: bridge .1, nodes .11, .12, .13), and a Ray cluster across
them: the head in node A, workers in B and C with custom resources.

Everything is named `<prefix><pid>` so parallel runs cannot collide, and
`Cluster.teardown()` removes exactly what it created: every process inside
its namespaces (`ip netns pids`, all started by this cluster), the
namespaces, the veth pairs, the bridge, the Ray folder. Traffic goes only to
these namespaces' addresses."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SUBNET = "198.18.0"
BRIDGE_IP = f"{SUBNET}.1"
RAY_PORT = 6390


def sh(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, timeout=timeout,
                          capture_output=True, text=True)


@dataclasses.dataclass
class Node:
    name: str          # A, B, C
    ns: str            # namespace name
    ip: str
    veth: str          # root-namespace end of its veth pair (link down = partition)

    def cmd(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *args]

    def pids(self) -> list[int]:
        out = sh("ip", "netns", "pids", self.ns, check=False).stdout
        return [int(p) for p in out.split()]

    def link(self, up: bool) -> None:
        sh("ip", "link", "set", self.veth, "up" if up else "down")


class Cluster:
    def __init__(self, prefix: str = "vpmn", node_local: str | None = None,
                 roles: str = "prefill,decode") -> None:
        """`node_local`: a folder name in the cluster's root that each worker
        node (B, C) sees as a folder of its own (root/<name>-<node> bound
        over root/<name> in the node's mount namespace, like a local disk at
        the same path on each host); A and the test see root/<name> itself.
        `roles`: the worker nodes' roles (B, C, D, ... in order; each gets
        that custom resource and the label pd-role=<role>)."""
        tag = f"{prefix}{os.getpid() % 100000}"
        self.tag = tag
        self.roles = dict(zip("BCDEF", roles.split(",")))
        self.bridge = f"{tag}br"[:15]
        self.nodes = {n: Node(n, f"{tag}-{n.lower()}", f"{SUBNET}.{11 + i}",
                              f"{tag}{n.lower()}"[:15])
                      for i, n in enumerate("A" + "".join(self.roles))}
        # short: Ray's AF_UNIX socket paths must fit in 107 bytes
        self.root = Path(f"/tmp/{tag}")
        self.node_local = node_local
        self.procs: list[subprocess.Popen] = []
        self.created: list[tuple[str, str]] = []  # (kind, name), teardown in reverse

    def node_of(self, role: str) -> list[str]:
        """The worker nodes of a role, in order (B, C, D, ...)."""
        return [n for n, r in self.roles.items() if r == role]

    @property
    def address(self) -> str:
        return f"{self.nodes['A'].ip}:{RAY_PORT}"

    def env(self) -> dict[str, str]:
        """The environment of a node's shell: the venv's tools first, Ray's
        token authentication off on the cluster and on its clients alike
        (the README's recipe), vLLM on the CPU."""
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        env.update({"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
                    "RAY_raylet_start_wait_time_s": "120",
                    "VLLM_TARGET_DEVICE": "cpu", "TMPDIR": str(self.root / "tmp")})
        return env

    # ---- network -------------------------------------------------------
    def build_network(self) -> None:
        self.root.mkdir(mode=0o700)
        (self.root / "tmp").mkdir()
        self.created.append(("dir", str(self.root)))
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self.created.append(("link", self.bridge))
        sh("ip", "addr", "add", f"{BRIDGE_IP}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for n in self.nodes.values():
            sh("ip", "netns", "add", n.ns)
            self.created.append(("netns", n.ns))
            peer = f"{n.veth}p"[:15]
            sh("ip", "link", "add", n.veth, "type", "veth", "peer", "name", peer)
            self.created.append(("link", n.veth))
            sh("ip", "link", "set", peer, "netns", n.ns)
            sh("ip", "link", "set", n.veth, "master", self.bridge)
            sh("ip", "link", "set", n.veth, "up")
            ex = ("ip", "netns", "exec", n.ns)
            sh(*ex, "ip", "link", "set", "lo", "up")
            sh(*ex, "ip", "link", "set", peer, "name", "eth0")
            sh(*ex, "ip", "addr", "add", f"{n.ip}/24", "dev", "eth0")
            sh(*ex, "ip", "link", "set", "eth0", "up")
            sh(*ex, "ip", "route", "add", "default", "via", BRIDGE_IP)

    # ---- processes -----------------------------------------------------
    def spawn(self, node: str, args: list[str], log: str, **kw) -> subprocess.Popen:
        f = open(self.root / log, "ab")
        p = subprocess.Popen(self.nodes[node].cmd(*args), stdout=f, stderr=subprocess.STDOUT,
                             env=kw.pop("env", None) or self.env(), start_new_session=True,
                             **kw)
        f.close()
        self.procs.append(p)
        return p

    def start_ray(self) -> None:
        common = ["--block", "--num-cpus", "1", "--disable-usage-stats"]
        a = self.nodes["A"]
        self.spawn("A", ["ray", "start", "--head", "--node-ip-address", a.ip,
                         "--port", str(RAY_PORT), "--temp-dir", str(self.root / "ray"),
                         "--include-dashboard=false",
                         "--resources", json.dumps({"head": 1}), *common], "ray-A.log")
        time.sleep(3)
        for k, n in enumerate(self.roles):
            self.start_worker(n)
            # one raylet at a time: on a busy 2-core host two registering at
            # once missed Ray's 30 s registration wait
            self.wait_nodes(k + 2, 180)

    def start_worker(self, n: str) -> subprocess.Popen:
        """Node n's Ray worker (`ray start --block`), with its role's
        resource and label; again after stop_node(n): the node back."""
        common = ["--block", "--num-cpus", "1", "--disable-usage-stats"]
        res = self.roles[n]
        args = ["ray", "start", "--address", self.address,
                "--node-ip-address", self.nodes[n].ip,
                "--resources", json.dumps({res: 1}),
                "--labels", json.dumps({"pd-role": res}), *common]
        if self.node_local:
            # `ip netns exec` runs in a mount namespace of its own (slave
            # of the host's): this bind mount is seen by the node's Ray
            # processes (raylet, actors, servers) only
            shared, own = self.local_folder(None), self.local_folder(n)
            shared.mkdir(exist_ok=True)
            own.mkdir(exist_ok=True)
            args = ["sh", "-c", 'mount --bind "$0" "$1" && shift && exec "$@"',
                    str(own), str(shared), *args]
        return self.spawn(n, args, f"ray-{n}.log")

    def stop_node(self, n: str) -> None:
        """Node n gone: every process in its namespace killed (its Ray
        worker, the supervisor actors, the servers), as a host that dies."""
        self.kill_node_processes(n)
        deadline = time.monotonic() + 30
        while self.nodes[n].pids() and time.monotonic() < deadline:
            time.sleep(0.2)

    def local_folder(self, node: str | None) -> Path:
        """The node-local folder as the host sees it: node B's or C's own,
        or (None) the one at the path they all use, A's."""
        assert self.node_local
        return self.root / (self.node_local if node is None
                            else f"{self.node_local}-{node}")

    def ray_nodes(self) -> list[dict]:
        code = ("import json, ray; ray.init(address=%r, log_to_driver=False); "
                "print(json.dumps([{'ip': n['NodeManagerAddress'], 'alive': n['Alive'], "
                "'res': n['Resources']} for n in ray.nodes()]))" % self.address)
        out = subprocess.run(self.nodes["A"].cmd(sys.executable, "-c", code), env=self.env(),
                             capture_output=True, text=True, timeout=90)
        if out.returncode:
            raise RuntimeError(out.stderr[-2000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    def wait_nodes(self, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            try:
                alive = [x for x in self.ray_nodes() if x["alive"]]
                if len(alive) >= n:
                    return
                last = alive
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                last = e
            time.sleep(2)
        raise RuntimeError(f"Ray cluster not up with {n} nodes: {last}; see {self.root}/ray-*.log")

    # ---- teardown ------------------------------------------------------
    def kill_node_processes(self, node: str, sig: int = signal.SIGKILL) -> None:
        for pid in self.nodes[node].pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def teardown(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(n.pids() for n in self.nodes.values()
                                                  if self._exists(n)):
            time.sleep(0.5)
        for n in self.nodes.values():
            if self._exists(n):
                self.kill_node_processes(n.name)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for kind, name in reversed(self.created):
            if kind == "netns":
                sh("ip", "netns", "del", name, check=False)
            elif kind == "link":
                sh("ip", "link", "del", name, check=False)
            elif kind == "dir":
                shutil.rmtree(name, ignore_errors=True)
        self.created.clear()

    def _exists(self, n: Node) -> bool:
        return Path(f"/var/run/netns/{n.ns}").exists()

    def leftovers(self) -> list[str]:
        out = []
        for n in self.nodes.values():
            if self._exists(n):
                out.append(f"netns {n.ns}")
        links = sh("ip", "-o", "link", "show", check=False).stdout
        out += [f"link {t}" for t in (self.bridge, *(n.veth for n in self.nodes.values()))
                if f" {t}:" in links or f" {t}@" in links]
        return out
