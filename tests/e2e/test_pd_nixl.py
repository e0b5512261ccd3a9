"""G4 end to end with NixlConnector on the CPU (kv_buffer_device "cpu", UCX
over DRAM between two processes on 127.0.0.1): the same P/D pair, workload
and checks as test_pd_example.py, with the async `WAITING_FOR_REMOTE_KVS`
path that ExampleConnector never takes. Needs `nixl` importable
(`pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1` next to the CPU torch).

    python -m pytest tests/e2e/test_pd_nixl.py -m e2e -q -s
    VLLM_PATCH_DISABLE=1 python -m pytest tests/e2e/test_pd_nixl.py -m e2e -q -s
"""

from __future__ import annotations

import pytest

from test_pd_example import (  # noqa: F401  (collected here with this module's `pd`)
    ASYNC,
    test_pd_bad_input,
    test_pd_client_disconnect,
    test_pd_kv_equals_local,
    test_pd_structured,
    test_pd_one_token_prompt,  # last: it may take the prefill server down
)

# In CI (patched and stock). It was opt-in until the cause of its "stall" was
# found: NixlConnector's CPU worker pins its main thread to the host's last
# core, so on the 2-core CI machine both instances' workers shared one core
# and the prefill worker's busy-spinning message-queue reader starved the
# decode worker (and the g++ of its one-time Inductor compile) for minutes.
# PDConfig.nixl() turns on the test-only switch that keeps each instance's
# transfer core within its own CPUs (vllm_patch.platforms.cpu).
pytestmark = [pytest.mark.e2e, pytest.mark.nixl]


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    pytest.importorskip("nixl._api", reason="nixl not installed")
    from vllm_patch.testing.pd_pair import PDConfig, PDPair

    storage = tmp_path_factory.mktemp("pd-nixl")
    with PDPair(PDConfig.nixl(str(storage), spec_k=3, force_async=ASYNC)) as pair:
        yield pair
