"""Start a P/D pair of vLLM OpenAI servers (+ the proxy) on 127.0.0.1.

Each server runs `python -m vllm.entrypoints.openai.api_server` in its own
session (process group); `stop()` signals only that group (SIGTERM, then
SIGKILL after a grace period). Both servers start concurrently. The proxy
(vllm_patch.launch.router) runs in a thread of the calling process.

    with PDPair(PDConfig(storage=tmpdir)) as pd:
        requests.post(pd.url + "/v1/completions", json=...)
        pd.metrics("decode")["vllm:kv_cache_usage_perc"]
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from vllm_patch.launch.router import ProxyThread, parse_metrics  # noqa: F401 (re-exported)
from vllm_patch.launch.supervisor import free_port, kill_group
from vllm_patch.testing.engine import STRUCTURED_OUTPUTS_CONFIG


@dataclasses.dataclass
class PDConfig:
    storage: str                       # ExampleConnector shared_storage_path
    model: str | None = None           # default: tiny target
    connector: str = "ExampleConnector"
    block_size: int = 32
    spec_k: int | None = 3             # draft_model = target; None: no spec decode
    force_async: bool = True           # VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # both servers
    role_env: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    extra_args: list[str] = dataclasses.field(default_factory=list)
    extra_connector_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    kv_load_failure_policy: str | None = None
    log_dir: str | None = None
    start_timeout_s: float = 240.0
    max_num_seqs: int = 8
    served_model_name: str | None = "tiny"

    @classmethod
    def nixl(cls, storage: str, **kw: Any) -> "PDConfig":
        """NixlConnector on the CPU: side channels on 127.0.0.1, a port each,
        a KV lease long enough for a slow 2-core machine, and each instance's
        NIXL transfer core taken from its own bound core, in the stock run
        too (VLLM_PATCH_NIXL_CPU_CORE_IN_BIND=1; vLLM puts every instance on
        the host's last core: vllm_patch.platforms.cpu)."""
        return cls(storage=storage, connector="NixlConnector",
                   env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                        "VLLM_PATCH_NIXL_CPU_CORE_IN_BIND": "1"},
                   role_env={"prefill": {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
                             "decode": {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}},
                   extra_connector_config={"kv_lease_duration": 300}, **kw)


def tiny_vllm_args(model: str, block_size: int = 32, spec_k: int | None = 3,
                   max_num_seqs: int = 8) -> list[str]:
    """vLLM server arguments for the tiny local model on a CPU (float32,
    256 MiB of KV cache, xgrammar, `draft_model` with the target as draft);
    shared by PDPair and `vllm-patch demo`."""
    args = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
            "--seed", "0", "--block-size", str(block_size),
            "--kv-cache-memory-bytes", str(256 * 2**20),
            "--max-num-seqs", str(max_num_seqs),
            "--structured-outputs-config", json.dumps(STRUCTURED_OUTPUTS_CONFIG)]
    if spec_k:
        args += ["--speculative-config", json.dumps(
            {"method": "draft_model", "model": model, "num_speculative_tokens": spec_k})]
    return args


def server_cmd(cfg: PDConfig, role: str, port: int) -> list[str]:
    from vllm_patch.testing.tiny_model import build_target

    model = cfg.model or str(build_target())
    kv = {"kv_connector": cfg.connector,
          "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
          "kv_connector_extra_config": {"shared_storage_path": cfg.storage,
                                        **cfg.extra_connector_config}}
    if cfg.connector == "NixlConnector":
        kv["kv_buffer_device"] = "cpu"
    if cfg.kv_load_failure_policy:
        kv["kv_load_failure_policy"] = cfg.kv_load_failure_policy
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--host", "127.0.0.1", "--port", str(port), "--model", model,
           "--kv-transfer-config", json.dumps(kv)]
    if cfg.served_model_name:
        cmd += ["--served-model-name", cfg.served_model_name]
    # extra_args last: they override the tiny defaults
    return (cmd + tiny_vllm_args(model, cfg.block_size, cfg.spec_k, cfg.max_num_seqs)
            + cfg.extra_args)


class Server:
    def __init__(self, cfg: PDConfig, role: str, core: int | None) -> None:
        self.role = role
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
                    "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "INFO")})
        if core is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        if cfg.force_async:
            env["VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING"] = "1"
        env.update(cfg.env)
        env.update(cfg.role_env.get(role, {}))
        log_dir = Path(cfg.log_dir or cfg.storage)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{role}-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.cmd = server_cmd(cfg, role, self.port)
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self.pgid = self.proc.pid  # new session => pgid == pid

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.metrics_text())

    def stop(self, grace_s: float = 20.0) -> None:
        kill_group(self.pgid, grace_s, self.proc)  # + engine core, workers
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def wait_healthy(servers: list[Server], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for s in list(pending):
            if s.proc.poll() is not None:
                raise RuntimeError(f"{s.role} server exited rc={s.proc.returncode}:\n"
                                   f"{s.log_tail()}")
            if s.healthy():
                pending.remove(s)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not healthy after {timeout_s}s: "
                               f"{[s.role for s in pending]}\n{pending[0].log_tail()}")
        time.sleep(1.0)


class PDPair:
    def __init__(self, cfg: PDConfig) -> None:
        self.cfg = cfg
        self.prefill: Server | None = None
        self.decode: Server | None = None
        self.proxy: ProxyThread | None = None
        self.start_s = 0.0

    @property
    def url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    def server(self, role: str) -> Server:
        s = self.prefill if role == "prefill" else self.decode
        assert s is not None
        return s

    def metrics(self, role: str) -> dict[str, float]:
        return self.server(role).metrics()

    def __enter__(self) -> "PDPair":
        t0 = time.monotonic()
        ncpu = len(os.sched_getaffinity(0))
        try:
            self.prefill = Server(self.cfg, "prefill", 0 if ncpu >= 2 else None)
            self.decode = Server(self.cfg, "decode", 1 if ncpu >= 2 else None)
            wait_healthy([self.prefill, self.decode], self.cfg.start_timeout_s)
            self.proxy = ProxyThread([self.prefill.url], [self.decode.url])
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.start_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        for s in (self.prefill, self.decode):
            if s is not None:
                s.stop()
