"""Multi-node tier: the real launcher across three network namespaces
(tests/multinode/netns.py). Root only; marker `multinode`."""

from __future__ import annotations

import os
import shutil

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/multinode/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.multinode)


@pytest.fixture
def cluster():
    yield from _cluster()


@pytest.fixture
def cluster_local_kv():
    """The cluster with a folder `kv` local to each node (same path, not
    shared): tests/multinode/netns.py Cluster(node_local=...)."""
    yield from _cluster(node_local="kv")


def _cluster(**kw):
    if os.geteuid() != 0:
        pytest.skip("the multi-node tier builds network namespaces: it needs root")
    if shutil.which("ip") is None:
        pytest.skip("the multi-node tier needs iproute2's `ip`")
    from .netns import Cluster

    c = Cluster(**kw)
    try:
        c.build_network()
        c.start_ray()
        yield c
    finally:
        c.teardown()
        assert c.leftovers() == []


@pytest.fixture
def cluster_1p2d():
    """A head (A), a prefill node (B) and two decode nodes (C, D)."""
    yield from _cluster(roles="prefill,decode,decode")


@pytest.fixture
def cluster_2p1d():
    """A head (A), two prefill nodes (B, D) and a decode node (C)."""
    yield from _cluster(roles="prefill,decode,prefill")
