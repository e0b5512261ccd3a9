"""Launcher tier: a real local multi-node Ray cluster on one machine
(`ray.cluster_utils.Cluster`: a head and two worker nodes with distinct
custom resources), shared by the session. Fast lifecycle tests supervise the
stand-in server (vllm_patch.testing.standin_server); test_launch_vllm.py runs
the real vLLM servers."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

NODES = {"head_node": "head", "prefill_node": "prefill", "decode_node": "decode"}


def pytest_collection_modifyitems(items):
    """Every test here is in the launch tier, except the pure-logic ones
    marked `unit` (no Ray, no server)."""
    for item in items:
        if ("tests/launch/" in str(item.fspath).replace(os.sep, "/")
                and item.get_closest_marker("unit") is None):
            item.add_marker(pytest.mark.launch)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    from ray.cluster_utils import Cluster

    # The cluster's folders in a short folder of its own, not /tmp/ray: Ray's
    # socket paths must stay under 107 bytes, and `Cluster` writes the head's
    # address to $RAY_TMPDIR/ray/ray_current_cluster (default /tmp/ray, which a
    # clean machine does not have: the head's start then fails).
    root = tempfile.mkdtemp(prefix="vp-ray-", dir="/tmp")
    temp = os.path.join(root, "ray")
    os.makedirs(temp)
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = root
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "resources": {"head_node": 1}, "include_dashboard": False,
            "temp_dir": temp})
        cluster.add_node(num_cpus=1, resources={"prefill_node": 1},
                         labels={"pd-role": "prefill"}, temp_dir=temp)
        cluster.add_node(num_cpus=1, resources={"decode_node": 1},
                         labels={"pd-role": "decode"}, temp_dir=temp)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def node_of_resource(ray_cluster) -> dict[str, str]:
    """custom resource -> Ray node id."""
    import ray

    out = {}
    for n in ray.nodes():
        for r in NODES:
            if n["Alive"] and n["Resources"].get(r):
                out[r] = n["NodeID"]
    assert set(out) == set(NODES), out
    return out
