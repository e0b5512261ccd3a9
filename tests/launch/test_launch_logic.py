"""The launcher's decisions, without Ray or a model (unit tier): the memory
split between the vLLM servers of one host, the user's own memory settings,
reading a server's exit cause from its log, and fail-fast on a start failure
that repeats (real subprocesses that fail at once, supervised by the real
InstanceSupervisor), and ExampleConnector's KV folder in a path the user
gives (made, refused with the path named, removed without the user's
files)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from vllm_patch.launch.config import LaunchConfig, LaunchError
from vllm_patch.launch.deployment import (
    MEMORY_HEADROOM, NIXL_KV_LEASE_S, VLLM_MEMORY_UTILIZATION, Deployment, Instance,
    memory_utilization, own_memory_setting)
from vllm_patch.launch.supervisor import (InstanceSupervisor, exit_cause, kv_folder,
                                          same_cause)

pytestmark = pytest.mark.unit

GiB = 1 << 30

# The log of a real vLLM 0.32 CPU server that could not get its memory (the
# root cause comes from a worker, then the engine core's and the API
# server's generic wrappers).
VLLM_LOG = """\
(APIServer pid=26585) WARNING 12-01 16:32:07 [system_utils.py:255] Found ulimit of 20000 \
and failed to automatically increase. This can cause fd limit errors like \
`OSError: [Errno 24] Too many open files`.
(VllmWorker-0 pid=27938) ERROR 12-01 16:35:47 [multiproc_executor.py:953] Traceback (most recent call last):
(VllmWorker-0 pid=27938) ERROR 12-01 16:35:47 [multiproc_executor.py:953] ValueError: \
Available memory on node 0 (10.06/15.34 GiB) on startup is less than desired CPU memory \
utilization (0.92, 14.11 GiB).
(EngineCore pid=27313) ERROR 12-01 16:35:54 [core.py:1510] Exception: WorkerProc \
initialization failed due to an exception in a background process. See stack trace for root cause.
Exception: WorkerProc initialization failed due to an exception in a background process. \
See stack trace for root cause.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_memory_split_between_the_servers_of_a_host():
    total = 16 * GiB
    # one server, memory free: vLLM's default fits, nothing is added
    assert memory_utilization(total, 15 * GiB, 1) is None
    # two servers, memory free: vLLM's 0.92 budget, capped at 70 % of the
    # available memory, split in two
    assert memory_utilization(total, 16 * GiB, 2) == 0.35
    assert memory_utilization(total, 8 * GiB, 2) == 0.175
    # the host: 15.37 of 19.84 GiB available; vLLM's default (0.92,
    # 18.25 GiB) fails for one server, let alone two
    util = memory_utilization(int(19.84 * GiB), int(15.37 * GiB), 2)
    assert util == pytest.approx(MEMORY_HEADROOM * 15.37 / 19.84 / 2, abs=1e-3)
    # the second server starts after the first has taken its share and
    # still finds its own (vLLM checks share <= available at start-up)
    share, available = util * 19.84, 15.37
    assert share <= available - share
    # one server on a busy host: capped too (vLLM's default would not fit)
    assert memory_utilization(total, 10 * GiB, 1) == pytest.approx(0.7 * 10 / 16, abs=1e-3)
    assert VLLM_MEMORY_UTILIZATION == 0.92


def test_a_users_memory_setting_is_kept():
    assert own_memory_setting(["--max-model-len", "512"], {}) is None
    assert own_memory_setting(["--kv-cache-memory-bytes", "1G"], {}) == \
        "--kv-cache-memory-bytes"
    assert own_memory_setting(["--gpu-memory-utilization=0.3"], {}) == \
        "--gpu-memory-utilization"
    assert own_memory_setting(["--device-memory-utilization", "0.3"], {}) == \
        "--device-memory-utilization"
    assert own_memory_setting([], {"VLLM_CPU_KVCACHE_SPACE": "2"}) == \
        "VLLM_CPU_KVCACHE_SPACE"
    assert own_memory_setting([], {"VLLM_CPU_KVCACHE_SPACE": ""}) is None


def test_exit_cause_is_the_root_cause():
    cause = exit_cause(VLLM_LOG, 1)
    assert cause.startswith("ValueError: Available memory on node 0 (10.06/15.34 GiB)")
    assert exit_cause("RuntimeError: Engine core initialization failed. See root "
                      "cause above.\n", 1).startswith("RuntimeError: Engine core")
    assert exit_cause("some output\n", -9) == "killed by SIGKILL"
    # pydantic's summary line gets the error that follows it
    assert exit_cause("pydantic_core._pydantic_core.ValidationError: 1 validation error "
                      "for ModelConfig\n  Value error, User-specified max_model_len "
                      "(100000) is greater than the derived max_model_len\n", 1) == (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for "
        "ModelConfig: Value error, User-specified max_model_len (100000) is greater "
        "than the derived max_model_len")
    # a warning that quotes an exception is not an exit cause
    assert exit_cause("(APIServer pid=1) WARNING 12-01 16:32:07 [x.py:1] "
                      "ValueError: ignored\n", -9) == "killed by SIGKILL"
    assert exit_cause("", 3) == "exit code 3"
    # a server that served and was then SIGKILLed: its log's handled
    # request errors are not why it exited
    assert exit_cause("(APIServer pid=1) ERROR 12-04 18:25:10 [serving.py:1] "
                      "RuntimeError: cancelled\n", -9) == "killed by SIGKILL"
    # the same error with other figures is the same error
    assert same_cause(cause, exit_cause(VLLM_LOG.replace("10.06", "9.87"), 1))
    assert not same_cause(cause, "OSError: [Errno 98] Address already in use")


def _supervise(tmp_path, code: str, max_restarts: int = 3) -> tuple[dict, float]:
    sup = InstanceSupervisor("decode-0", max_restarts=max_restarts,
                             log_dir=str(tmp_path), deployment_id="unit")
    sup.prepare("standin", None, {})
    t0 = time.monotonic()
    sup.start([sys.executable, "-c", code], {}, sup.port or 1)
    try:
        while sup.status(check_health=False)["state"] not in ("failed",) \
                and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        return sup.status(check_health=False), time.monotonic() - t0
    finally:
        sup.stop(grace_s=2)
        sup.cleanup(keep_logs=False)


def test_a_start_failure_that_repeats_is_not_restarted_again(tmp_path):
    st, took = _supervise(tmp_path, "raise ValueError('no model at /nowhere')")
    assert st["state"] == "failed" and st["spawns"] == 2, st
    assert st["error"] == ("decode-0: the server failed to start twice with the same "
                           "error, not restarted again: ValueError: no model at /nowhere")
    assert took < 15, took


def test_different_start_failures_use_the_restarts(tmp_path):
    # each run fails differently (a counter in a file): restarted up to the maximum
    counter = tmp_path / "n"
    code = (f"import pathlib; p = pathlib.Path({str(counter)!r}); "
            "n = int(p.read_text()) if p.exists() else 0; p.write_text(str(n + 1)); "
            "raise SystemExit(10 + n)")
    st, _ = _supervise(tmp_path, code, max_restarts=2)
    assert st["state"] == "failed" and st["spawns"] == 3, st
    assert st["exits"] == [10, 11, 12]
    assert "restarted 2 time(s), the maximum (max_restarts=2)" in st["error"]


def _deployment(available_gib: float, hosts: tuple[str, str] = ("h1", "h1"),
                **cfg) -> Deployment:
    """A deployment's memory decision for a prefill and a decode server
    placed on `hosts` (no Ray: the placement's answers filled in)."""
    dep = Deployment(LaunchConfig(model="m", **cfg))
    dep._gpu_nodes = set()
    mem = {"node": 0, "total": 16 * GiB, "available": int(available_gib * GiB)}
    dep.instances = [Instance(role, 0, None, info={
        "ip": host, "node_id": host, "memory": mem, "kvcache_env": ""})
        for role, host in zip(("prefill", "decode"), hosts)]
    return dep


def test_memory_flags_given_to_the_servers():
    gpu = ["--gpu-memory-utilization", "0.35"]
    assert _deployment(16)._memory_args() == {"prefill-0": gpu, "decode-0": gpu}
    # one server per host with its memory free: vLLM's default, untouched
    assert _deployment(16, ("h1", "h2"))._memory_args() == {
        "prefill-0": [], "decode-0": []}
    # a user's setting is kept, for one role or for all
    own = _deployment(16, decode={"vllm_args": "--kv-cache-memory-bytes 1G"})
    assert own._memory_args() == {"prefill-0": gpu, "decode-0": []}
    assert _deployment(16, env={"VLLM_CPU_KVCACHE_SPACE": "2"})._memory_args() == {
        "prefill-0": [], "decode-0": []}
    # too little for two servers: refused before anything starts, flag named
    with pytest.raises(LaunchError, match=r"2 vLLM server\(s\) on h1 would get 1\.0 GiB "
                       r"of memory each .* --kv-cache-memory-bytes"):
        _deployment(3)._memory_args()


def test_nixl_kv_lease_set_unless_the_user_sets_it():
    """NixlConnector: kv_lease_duration (how long a prefill server keeps a
    prompt's KV blocks for a decode server that has not read them) is the
    launcher's 120 s, not vLLM's 30 s, unless the user gives one; other
    connectors get none."""
    dep = _deployment(16, ("h1", "h2"))
    for inst in dep.instances:
        kv = dep._kv_config(inst)
        assert kv["kv_connector_extra_config"]["kv_lease_duration"] == NIXL_KV_LEASE_S == 120
        assert kv["kv_buffer_device"] == "cpu"
    own = _deployment(16, ("h1", "h2"), kv_connector_extra_config={"kv_lease_duration": 7})
    assert own._kv_config(own.instances[0])["kv_connector_extra_config"] == {
        "kv_lease_duration": 7}
    ex = _deployment(16, ("h1", "h2"), connector="ExampleConnector")
    assert "kv_lease_duration" not in ex._kv_config(ex.instances[0])[
        "kv_connector_extra_config"]


def test_nixl_core_fix_read_from_each_servers_switches(monkeypatch):
    """Whether the NIXL transfer-core fix runs in a server (the launcher warns
    for NixlConnector servers sharing a host without it): its own switch,
    else on unless VLLM_PATCH_DISABLE=1; a patched vLLM build carries it
    whatever the switches say."""
    from vllm_patch import series

    monkeypatch.delenv("VLLM_PATCH_DISABLE", raising=False)
    monkeypatch.delenv("VLLM_PATCH_NIXL_CPU_CORE_IN_BIND", raising=False)
    monkeypatch.setattr(series, "native_patch_ids", lambda: {})
    cases = [({}, True), ({"VLLM_PATCH_DISABLE": "1"}, False),
             ({"VLLM_PATCH_NIXL_CPU_CORE_IN_BIND": "0"}, False),
             ({"VLLM_PATCH_DISABLE": "1", "VLLM_PATCH_NIXL_CPU_CORE_IN_BIND": "1"},
              True)]
    for env, on in cases:
        dep = _deployment(16, env=env)
        assert dep._nixl_core_fix_on(dep.instances[0]) is on, env
    monkeypatch.setattr(series, "native_patch_ids",
                        lambda: {"cpu-nixl-kv-core-in-bind": "cpu_kv_transfer_core"})
    for env, _ in cases:
        dep = _deployment(16, env=env)
        assert dep._nixl_core_fix_on(dep.instances[0]) is True, env


def _kv_supervisor(tmp_path, name: str = "prefill-0") -> InstanceSupervisor:
    return InstanceSupervisor(name, log_dir=str(tmp_path / "logs"), deployment_id="abcd1234")


def test_kv_folder_in_a_users_path_is_the_deployments_own(tmp_path):
    """ExampleConnector with a shared_storage_path the user gave: each
    supervisor makes `<path>/vllm-patch-<id>` (a folder the nodes share is
    made once and removed once), cleanup removes it with every KV file in
    it, and the user's own files in the path stay."""
    user = tmp_path / "kv"
    user.mkdir()
    (user / "mine.txt").write_text("the user's")
    (user / "vllm-patch-other").mkdir()  # another deployment's folder
    kv = kv_folder(str(user), "abcd1234")
    assert kv == str(user / "vllm-patch-abcd1234")
    sups = [_kv_supervisor(tmp_path, n) for n in ("prefill-0", "decode-0")]
    for s in sups:
        s.prepare("standin", None, {}, kv)
    assert Path(kv).is_dir()
    (Path(kv) / "0123abcd").mkdir()
    (Path(kv) / "0123abcd" / "layer.0.safetensors").write_bytes(b"kv")
    assert [s.cleanup(keep_logs=False) for s in sups] == [
        {"log": None, "kv_dir": None}] * 2
    assert sorted(p.name for p in user.iterdir()) == ["mine.txt", "vllm-patch-other"]
    assert (user / "mine.txt").read_text() == "the user's"


def test_kv_folder_a_relative_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert kv_folder("kv", "ab") == str(tmp_path / "kv" / "vllm-patch-ab")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert kv_folder("~/kv", "ab") == str(tmp_path / "kv" / "vllm-patch-ab")


def test_cleanup_never_removes_the_users_path(tmp_path):
    user = tmp_path / "kv"
    user.mkdir()
    (user / "mine.txt").write_text("x")
    sup = _kv_supervisor(tmp_path)
    sup.prepare("standin", None, {})
    sup.kv_dir = user  # not the deployment's own folder: kept whatever it holds
    sup.cleanup(keep_logs=False)
    assert (user / "mine.txt").exists()


@pytest.mark.parametrize("make, reason", [
    (lambda p: None, "does not exist"),
    (lambda p: p.write_text("a file"), "is not a folder"),
])
def test_a_missing_kv_path_is_refused_naming_it(tmp_path, make, reason):
    user = tmp_path / "nowhere"
    make(user)
    sup = _kv_supervisor(tmp_path)
    with pytest.raises(LaunchError) as e:
        sup.prepare("standin", None, {}, kv_folder(str(user), "abcd1234"))
    assert str(e.value).startswith(
        f"prefill-0 on node {sup.host}: shared_storage_path (kv_connector_extra_config) "
        f"{user} {reason} on this node"), e.value
    assert sup.kv_dir is None


def test_an_unwritable_kv_path_is_refused_naming_it(tmp_path, monkeypatch):
    user = tmp_path / "ro"
    user.mkdir()
    real_mkdir = Path.mkdir

    def mkdir(self, *a, **kw):
        if self.parent == user:
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", mkdir)  # root may write anywhere
    sup = _kv_supervisor(tmp_path)
    with pytest.raises(LaunchError, match=rf"shared_storage_path \(kv_connector_extra_"
                       rf"config\) {user} is not writable on this node \(cannot create "
                       r"vllm-patch-abcd1234 in it: Permission denied\)"):
        sup.prepare("standin", None, {}, kv_folder(str(user), "abcd1234"))
    assert list(user.iterdir()) == []


def test_the_default_kv_folder_of_another_nodes_path_is_made_and_removed(tmp_path):
    """The launcher's default KV folder is in the prefill node's deployment
    folder; a supervisor whose temp dir differs makes that path and removes
    it again (nothing of the deployment stays)."""
    other = tmp_path / "elsewhere" / "vllm-patch-launch-abcd1234" / "kv"
    sup = _kv_supervisor(tmp_path)
    sup.prepare("standin", None, {}, str(other))
    assert other.is_dir()
    sup.cleanup(keep_logs=False)
    assert list((tmp_path / "elsewhere").iterdir()) == []
