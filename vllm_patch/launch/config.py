"""Configuration of a P/D deployment: a YAML file and/or flags.

Everything is validated before anything starts (unknown keys, types, counts,
port ranges); what can only be checked on a node (the model path, a port in
use, the plugin installed) is checked by that node's supervisor actor before
it starts its server, and reported with the node's address.

    model: /models/tiny            # a path must exist on every node
    address: auto                  # Ray cluster; omitted: start a local one
    connector: NixlConnector
    kv_connector_extra_config: {kv_lease_duration: 300}   # ExampleConnector's
                                   # shared_storage_path: default in the deployment's temp
                                   # folder; one given gets a subfolder vllm-patch-<id>
                                   # of the deployment's own, removed at the stop
    vllm_args: [--max-model-len, "512"]      # both roles; passed to vLLM as is
    prefill: {count: 1, node_resource: prefill_node, port: 8100}   # or node_labels: {...}
    decode:  {count: 2, node_resource: decode_node, vllm_args: [--speculative-config, '{...}']}
    router:  {host: 0.0.0.0, port: 8000}
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ROLES = ("prefill", "decode")
DEFAULT_SERVER_COMMAND = ["{python}", "-m", "vllm.entrypoints.openai.api_server"]


class LaunchError(Exception):
    """A deployment cannot start or keep running; the message says why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RoleConfig(_Strict):
    count: int = Field(1, ge=1, le=64)
    # Ray custom resource that marks the nodes this role may run on (e.g.
    # `ray start --resources '{"prefill_node": 1}'`); None: any node.
    node_resource: str | None = None
    # Ray node labels the role's nodes must carry (`ray start --labels
    # '{"pd-role": "decode"}'`); with node_resource, both must hold.
    node_labels: dict[str, str] = Field(default_factory=dict)
    # First port; instance i of the role serves on port + i. None: a free port
    # chosen on the instance's node.
    port: int | None = Field(None, ge=1024, le=65535)
    vllm_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    # CPU nodes: VLLM_CPU_OMP_THREADS_BIND. "auto": instances on one host get
    # disjoint core ranges (none set when there are more instances than
    # cores); "off": vLLM's default; anything else is passed as is.
    cpu_bind: str = "auto"

    @field_validator("vllm_args", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        return shlex.split(v) if isinstance(v, str) else v


class RouterConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)  # 0: any free port


class LaunchConfig(_Strict):
    model: str
    served_model_name: str | None = None
    # Ray address ("auto", "ray://host:10001", "host:6379"); None: RAY_ADDRESS
    # if set, else a local single-node Ray started (and stopped) by us.
    address: str | None = None
    connector: str = "NixlConnector"
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    # extra kv_transfer_config keys (e.g. kv_buffer_device, kv_load_failure_policy)
    kv_transfer_config: dict[str, Any] = Field(default_factory=dict)
    vllm_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    prefill: RoleConfig = Field(default_factory=RoleConfig)
    decode: RoleConfig = Field(default_factory=RoleConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    max_restarts: int = Field(3, ge=0)
    start_timeout_s: float = Field(600.0, gt=0)
    # Seconds a supervisor actor may stay unreachable (Ray's transient
    # ActorUnavailableError, or no answer in time: a partitioned or frozen
    # node) before the launcher counts it as dead; meanwhile it logs the
    # node as unreachable and keeps polling. A dead actor counts at once.
    unreachable_grace_s: float = Field(120.0, ge=0)
    # Seconds a role may have no serving instance (its last one lost: its
    # node gone, declared dead by Ray, or unreachable past the grace) before
    # the deployment stops; meanwhile the router answers that role's
    # requests with 503 and the launcher starts the instance again on a
    # node of its role as soon as one is in the cluster. 0: stop at once.
    recovery_timeout_s: float = Field(600.0, ge=0)
    # The server each instance supervises; "{python}" is the node's Python.
    server_command: list[str] = Field(default_factory=lambda: list(DEFAULT_SERVER_COMMAND))
    # Server logs on each node, always kept; None: the deployment's temp
    # folder there, removed at the end unless the deployment failed.
    log_dir: str | None = None

    @field_validator("vllm_args", "server_command", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        return shlex.split(v) if isinstance(v, str) else v

    @field_validator("vllm_args")
    @classmethod
    def _no_owned_flags(cls, v: list[str]) -> list[str]:
        owned = {"--host", "--port", "--kv-transfer-config", "--model"}
        clash = sorted({a.split("=", 1)[0] for a in v} & owned)
        if clash:
            raise ValueError(f"{', '.join(clash)} are set by the launcher "
                             "(use model:, prefill/decode port:, connector:)")
        return v

    def role(self, name: str) -> RoleConfig:
        return self.prefill if name == "prefill" else self.decode


def _errors(e: ValidationError, source: str) -> LaunchError:
    lines = [f"invalid launch configuration ({source}):"]
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  {loc}: {err['msg']}")
    return LaunchError("\n".join(lines))


def load(path: str | None, overrides: dict[str, Any] | None = None) -> LaunchConfig:
    """YAML file (optional) + overrides (flags; nested dicts merge)."""
    data: dict[str, Any] = {}
    source = "flags"
    if path:
        import yaml

        p = Path(path)
        if not p.is_file():
            raise LaunchError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise LaunchError(f"config file {path} is not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise LaunchError(f"config file {path} must hold a mapping, "
                              f"not {type(loaded).__name__}")
        data = loaded or {}
        source = f"{path} + flags" if overrides else path
    _merge(data, overrides or {})
    try:
        return LaunchConfig.model_validate(data)
    except ValidationError as e:
        raise _errors(e, source) from None


def _merge(base: dict[str, Any], over: dict[str, Any]) -> None:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


def model_is_path(model: str) -> bool:
    """A model given as a path must exist on every node (no hub lookup)."""
    return model.startswith(("/", "./", "../", "~")) or Path(model).exists()
