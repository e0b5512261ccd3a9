"""Launcher tier: a real local multi-node Ray cluster on one machine
(`ray.cluster_utils.Cluster`: a head and two worker nodes with distinct
custom resources), shared by the session. Fast lifecycle tests supervise the
stand-in server (vllm_patch.testing.standin_server); test_launch_vllm.py runs
the real vLLM servers."""

from __future__ import annotations

import os

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
def ray_cluster(tmp_path_factory):
    import ray
    from ray.cluster_utils import Cluster

    # the cluster's session folder in pytest's temp dir, not /tmp/ray
    temp = str(tmp_path_factory.mktemp("ray"))
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"head_node": 1}, "include_dashboard": False,
        "temp_dir": temp})
    cluster.add_node(num_cpus=1, resources={"prefill_node": 1}, labels={"pd-role": "prefill"},
                     temp_dir=temp)
    cluster.add_node(num_cpus=1, resources={"decode_node": 1}, labels={"pd-role": "decode"},
                     temp_dir=temp)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


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
