"""`vllm-patch launch`: a P/D deployment on a Ray cluster, until Ctrl-C.

    vllm-patch launch --model /models/m --prefill-resource prefill_node \\
        --decode-resource decode_node --port 8000 -- --max-model-len 4096
    vllm-patch launch --config pd.yaml

Arguments after `--` go to every vLLM server unchanged; --prefill-args /
--decode-args (one quoted string each) go to one role. Flags override the
YAML file (see vllm_patch/launch/config.py for its keys). Progress and
errors go to stderr; the endpoint line `endpoint: http://host:port` to
stdout, and with --ready-file a JSON file {"url", "instances"} is written
once every instance answers /health. Ctrl-C, SIGINT or SIGTERM (also when
the command runs in the background) tears everything down; a signal that
arrives while it is stopping only says so (the stop goes on to the end).

Memory: on the CPU, vLLM reserves --gpu-memory-utilization (default 0.92) of
the host's memory for each server. Servers that share a host get a share
each (two servers on a host with its memory free: 0.35 each); a
server given --gpu-memory-utilization, --kv-cache-memory-bytes or
VLLM_CPU_KVCACHE_SPACE keeps the user's setting.

Files: each node keeps the deployment's files in
<temp dir>/vllm-patch-launch-<id>: server logs (or in --log-dir), the
ExampleConnector KV storage (with a shared_storage_path given: in
<that path>/vllm-patch-<id>, the rest of that folder untouched), vLLM's
sockets (in /tmp/vllm-patch-ipc-<id> when TMPDIR is too long for a
socket's 107-byte path). A local Ray cluster the
command starts keeps its files in /tmp/vllm-patch-ray-<id>. At the end the
KV storage, the sockets and Ray's files are removed, and the logs too unless
the deployment failed (then the last line says where they are).

A server that never became healthy and fails twice with the same error is
not restarted again: the command stops everything and prints the error and
the server's last log lines.

A node that stops answering (a network partition, a frozen host) is logged
as unreachable and polled again. An instance whose supervisor is gone (its
node lost), or unreachable for longer than --unreachable-grace seconds, is
lost: the others of its role serve meanwhile, and it is started again on a
node of its role once one is in the cluster. A role left with no instance
gets 503s until one is back, and stops the deployment after
--recovery-timeout seconds.

Exit codes: 0 after a requested stop, 1 when the deployment cannot start,
an instance keeps dying (more than --max-restarts restarts) or a role has
no instance for longer than --recovery-timeout, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

_stopping = False


def _overrides(a: argparse.Namespace) -> dict[str, Any]:
    o: dict[str, Any] = {}
    for key in ("model", "address", "connector", "max_restarts", "log_dir",
                "served_model_name", "server_command"):
        v = getattr(a, key)
        if v is not None:
            o[key] = v
    if a.start_timeout is not None:
        o["start_timeout_s"] = a.start_timeout
    if a.unreachable_grace is not None:
        o["unreachable_grace_s"] = a.unreachable_grace
    if a.recovery_timeout is not None:
        o["recovery_timeout_s"] = a.recovery_timeout
    if a.vllm_args:
        o["vllm_args"] = a.vllm_args
    if a.kv_connector_extra_config is not None:
        o["kv_connector_extra_config"] = a.kv_connector_extra_config
    router = {k: v for k, v in (("host", a.host), ("port", a.port)) if v is not None}
    if router:
        o["router"] = router
    for role in ("prefill", "decode"):
        r = {k: v for k, v in (("count", getattr(a, role)),
                               ("node_resource", getattr(a, f"{role}_resource")),
                               ("node_labels", getattr(a, f"{role}_labels")),
                               ("port", getattr(a, f"{role}_port")),
                               ("vllm_args", getattr(a, f"{role}_args")))
             if v is not None}
        if r:
            o[role] = r
    return o


def _labels(text: str) -> dict[str, str]:
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE[,KEY=VALUE], got {text!r}")
        out[key.strip()] = value.strip()
    return out


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _stop(signum: int, frame: Any) -> None:
    """SIGINT / SIGTERM: stop (once). A signal while stopping, or while a
    deployment is closing after an error, is acknowledged and otherwise
    ignored: the close finishes, so every server and folder goes and the
    error that caused it is still printed."""
    global _stopping
    from vllm_patch.launch import deployment

    if _stopping or deployment.closing():
        print(f"{signal.Signals(signum).name}: already stopping, please wait until "
              "every server has stopped", file=sys.stderr, flush=True)
        return
    _stopping = True
    raise KeyboardInterrupt


def handle_stop_signals() -> None:
    """SIGINT and SIGTERM both stop the command. Set explicitly: a command
    started with `&` by a non-interactive shell inherits SIGINT ignored, and
    Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)


def main(a: argparse.Namespace) -> int:
    from vllm_patch.launch import show_progress
    from vllm_patch.launch.config import LaunchError, load
    from vllm_patch.launch.deployment import Deployment

    show_progress()
    try:
        cfg = load(a.config, _overrides(a))
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    handle_stop_signals()
    try:
        with Deployment(cfg) as dep:
            print(f"endpoint: {dep.url}", flush=True)
            if a.ready_file:
                with open(a.ready_file, "w") as f:
                    json.dump({"url": dep.url, "instances": [
                        {"name": i.name, "url": i.url, "node_id": i.info["node_id"],
                         "pid": i.status["pid"]} for i in dep.instances]}, f)
            dep.serve_forever()
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
        return 0
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("launch", help="P/D deployment on a Ray cluster (prefill + "
                       "decode vLLM servers with this plugin, router in front)",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file (keys of LaunchConfig)")
    p.add_argument("--model", help="model path (must exist on every node) or name")
    p.add_argument("--served-model-name")
    p.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else start "
                   "a local Ray)")
    p.add_argument("--connector", help="KV connector (default NixlConnector)")
    p.add_argument("--kv-connector-extra-config", type=_json_object, metavar="JSON",
                   help="the connector's kv_connector_extra_config (e.g. "
                   "'{\"shared_storage_path\": \"/shared/kv\"}' for ExampleConnector "
                   "across hosts: a folder every node mounts, where the launch keeps "
                   "its KV files in a subfolder of its own, vllm-patch-<id>, removed "
                   "at the stop; default: the deployment's temp folder)")
    p.add_argument("--prefill", type=int, help="number of prefill instances (default 1)")
    p.add_argument("--decode", type=int, help="number of decode instances (default 1)")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-resource", metavar="RESOURCE",
                       help=f"Ray custom resource of the {role} nodes")
        p.add_argument(f"--{role}-labels", type=_labels, metavar="K=V[,K=V]",
                       help=f"Ray node labels the {role} nodes carry")
        p.add_argument(f"--{role}-port", type=int, metavar="PORT",
                       help=f"first {role} port (instance i: PORT+i; default: free)")
        p.add_argument(f"--{role}-args", metavar="'ARGS'",
                       help=f"extra vLLM arguments for {role} only (one quoted string)")
    p.add_argument("--host", help="router host (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="router port (default 8000; 0: free)")
    p.add_argument("--max-restarts", type=int, help="restarts per instance (default 3)")
    p.add_argument("--start-timeout", type=float, help="seconds to wait for /health")
    p.add_argument("--unreachable-grace", type=float, metavar="SECONDS",
                   help="how long a node may stay unreachable (a network partition, "
                   "Ray's transient errors) before its instances count as lost "
                   "(default 120)")
    p.add_argument("--recovery-timeout", type=float, metavar="SECONDS",
                   help="how long a role may have no serving instance (its last one "
                   "lost with its node) while the launcher waits for a node of that "
                   "role to start it again, before the deployment stops (default "
                   "600; 0: stop at once)")
    p.add_argument("--log-dir", metavar="DIR",
                   help="server logs, on each node, always kept (default: the "
                   "deployment's temp folder, kept only if the deployment fails)")
    p.add_argument("--server-command", help=argparse.SUPPRESS)  # tests: a stand-in
    p.add_argument("--ready-file", help="write {url, instances} as JSON when ready")
    p.add_argument("vllm_args", nargs="*", metavar="-- VLLM_ARGS",
                   help="arguments after -- go to every vLLM server")
    p.set_defaults(func=main)
