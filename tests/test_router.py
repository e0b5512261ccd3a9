"""The P/D router's HTTP surface without vLLM: the real router
(vllm_patch.launch.router, in its ProxyThread) in front of tiny aiohttp
stand-ins for the prefill and decode instances (the instances are outside
the code under test; tests/e2e/test_router_openai.py runs the same calls
against real vLLM servers). Checks: unknown path -> 404 and wrong method ->
405 in OpenAI's error format; the read-only endpoints answered by a decode
instance with its status and body passed through; an instance's 4xx reaches
the client unchanged (never a 5xx); an unreachable decode instance is skipped
for reads, none reachable -> 502; the official openai client's models calls.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

pytestmark = pytest.mark.unit

MODELS = {"object": "list", "data": [
    {"id": "tiny", "object": "model", "created": 0, "owned_by": "vllm", "root": "/m/tiny",
     "parent": None, "max_model_len": 512, "permission": []}]}
# a 400 as vLLM writes it (bytes compared as they are: odd spacing on purpose)
BAD = b'{"error": {"message": "bad  schema", "type": "BadRequestError", "param": null, "code": 400}}'


class Served:
    """An aiohttp app on an ephemeral port, in a thread with its own loop."""

    def __init__(self, app) -> None:
        from aiohttp import web

        from vllm_patch.launch.supervisor import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app, access_log=None)
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            self.loop.run_until_complete(
                web.TCPSite(self.runner, "127.0.0.1", self.port).start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def fake_instance(role: str, seen: list):
    """A stand-in vLLM server: the routes the router uses, nothing else
    (an unknown path gets aiohttp's own plain-text 404)."""
    from aiohttp import web

    async def completions(request):
        body = await request.json()
        seen.append((role, request.path, body))
        if body.get("prompt") == f"{role}-400":
            return web.Response(status=400, body=BAD, content_type="application/json")
        if role == "prefill":
            return web.json_response({"choices": [{"text": "x"}],
                                      "kv_transfer_params": {"from": "prefill"}})
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "created": 0,
                                  "model": "tiny", "choices": [
                                      {"index": 0, "text": "hi", "finish_reason": "stop",
                                       "logprobs": None}]})

    async def models(request):
        seen.append((role, "/v1/models", request.headers.get("Authorization")))
        return web.json_response(MODELS)

    async def version(request):
        return web.json_response({"version": "0.0-fake"})

    async def tokenize(request):
        body = await request.json()
        seen.append((role, "/tokenize", body))
        if body.get("prompt") == "":
            return web.Response(status=400, body=BAD, content_type="application/json")
        return web.json_response({"tokens": [1, 2], "count": 2, "max_model_len": 512})

    async def health(request):
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    app.router.add_post("/tokenize", tokenize)
    return app


@pytest.fixture(scope="module")
def stack():
    """router -> a prefill stand-in and a decode stand-in; the stand-ins'
    URLs too (for routers of other shapes)."""
    from vllm_patch.launch.router import ProxyThread

    seen: list = []
    prefill = Served(fake_instance("prefill", seen))
    decode = Served(fake_instance("decode", seen))
    router = ProxyThread([prefill.url], [decode.url])
    router.instances = (prefill.url, decode.url)
    yield router, seen
    router.stop()
    decode.stop()
    prefill.stop()


def _openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    return err


def test_unknown_path_is_openai_404(stack):
    import requests

    router, _ = stack
    for method, path in (("GET", "/nope"), ("POST", "/v1/nope"), ("GET", "/v1/files")):
        err = _openai_error(requests.request(method, router.url + path, timeout=10), 404)
        assert err["type"] == "Not Found"  # vLLM's server: the HTTP phrase
        assert err["message"] == f"Not Found: {method} {path}"


def test_wrong_method_is_openai_405(stack):
    import requests

    router, _ = stack
    r = requests.get(router.url + "/v1/completions", timeout=10)
    err = _openai_error(r, 405)
    assert err["type"] == "Method Not Allowed"
    assert "POST" in err["message"] and r.headers["Allow"] == "POST"
    r = requests.post(router.url + "/v1/models", json={}, timeout=10)
    _openai_error(r, 405)
    assert "GET" in r.headers["Allow"]


def test_read_only_endpoints_pass_through(stack):
    import requests

    router, seen = stack
    r = requests.get(router.url + "/v1/models", timeout=10,
                     headers={"Authorization": "Bearer k"})
    assert r.status_code == 200 and r.json() == MODELS
    assert ("decode", "/v1/models", "Bearer k") in seen  # the client's key goes along
    assert requests.get(router.url + "/version", timeout=10).json() == {"version": "0.0-fake"}
    r = requests.post(router.url + "/tokenize", json={"prompt": "ab"}, timeout=10)
    assert r.status_code == 200 and r.json()["tokens"] == [1, 2]
    assert ("decode", "/tokenize", {"prompt": "ab"}) in seen
    # the instance's error: its status and its bytes
    r = requests.post(router.url + "/tokenize", json={"prompt": ""}, timeout=10)
    assert (r.status_code, r.content) == (400, BAD)
    # an endpoint the instance does not serve: its status passed through
    r = requests.get(router.url + "/tokenizer_info", timeout=10)
    assert r.status_code == 404
    assert not any(role == "prefill" and p != "/v1/completions" for role, p, *_ in seen)


def test_instance_errors_reach_client_unchanged(stack):
    import requests

    router, seen = stack
    for role in ("prefill", "decode"):
        for stream in (False, True):
            r = requests.post(router.url + "/v1/completions", timeout=10, json={
                "model": "tiny", "prompt": f"{role}-400", "max_tokens": 4, "stream": stream})
            assert (r.status_code, r.content) == (400, BAD), (role, stream, r.text)
    # the P/D flow itself: decode got the prefill's kv_transfer_params
    r = requests.post(router.url + "/v1/completions", timeout=10,
                      json={"model": "tiny", "prompt": "ok", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hi"
    assert seen[-1][2]["kv_transfer_params"] == {"from": "prefill"}


def test_invalid_json_body_is_openai_400(stack):
    import requests

    router, _ = stack
    r = requests.post(router.url + "/v1/chat/completions", data=b"{not json",
                      headers={"Content-Type": "application/json"}, timeout=10)
    assert _openai_error(r, 400)["type"] == "BadRequestError"


def test_read_only_skips_unreachable_decode(stack):
    """Reads go round robin over the decode instances; one that cannot be
    reached is skipped (the request only reads)."""
    import requests

    from vllm_patch.launch.router import ProxyThread
    from vllm_patch.launch.supervisor import free_port

    prefill, decode = stack[0].instances
    router = ProxyThread([prefill], [f"http://127.0.0.1:{free_port()}", decode])
    try:
        for _ in range(3):  # each start of the round robin
            r = requests.get(router.url + "/v1/models", timeout=30)
            assert r.status_code == 200 and r.json() == MODELS
    finally:
        router.stop()


def test_no_decode_instance_reachable_is_502():
    import requests

    from vllm_patch.launch.router import ProxyThread
    from vllm_patch.launch.supervisor import free_port

    down = f"http://127.0.0.1:{free_port()}"
    router = ProxyThread([down], [down])
    try:
        for method, path, body in (("GET", "/v1/models", None),
                                   ("POST", "/tokenize", {"prompt": "a"}),
                                   ("GET", "/v1/models/tiny", None),
                                   ("POST", "/v1/completions", {"prompt": "a"})):
            r = requests.request(method, router.url + path, json=body, timeout=30)
            assert _openai_error(r, 502)["type"] == "BadGatewayError", path
    finally:
        router.stop()


def test_health_and_metrics_do_not_wait_on_an_instance_that_never_answers(stack):
    """A prefill node cut off: its socket takes the connection and never
    answers. /health says so (503, that instance 599, the live one 200)
    within a client's usual 10 s, and /metrics does not wait for it either
    (each instance had 10 s, and a client gave up first)."""
    import socket
    import time

    import requests

    from vllm_patch.launch import router as rt
    from vllm_patch.launch.router import ProxyThread

    _, decode = stack[0].instances
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(16)  # connections complete in the kernel; nothing answers
    cut = f"http://127.0.0.1:{mute.getsockname()[1]}"
    router = ProxyThread([cut], [decode])
    try:
        t0 = time.monotonic()
        r = requests.get(router.url + "/health", timeout=10)
        took = time.monotonic() - t0
        assert r.status_code == 503 and r.json() == {cut: 599, decode: 200}
        assert took < rt.HEALTH_TIMEOUT_S + 2, took
        t0 = time.monotonic()
        r = requests.get(router.url + "/metrics", timeout=10)
        assert r.status_code == 200
        assert time.monotonic() - t0 < rt.METRICS_TIMEOUT_S + 2
    finally:
        router.stop()
        mute.close()


def test_openai_client_models(stack):
    import openai

    router, _ = stack
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("other")
    assert e.value.body == {"message": "The model `other` does not exist.",
                            "type": "NotFoundError", "param": "model", "code": 404}
    with pytest.raises(openai.NotFoundError) as e:
        client.get("/nope", cast_to=object)
    assert e.value.body["type"] == "Not Found"
    assert client.completions.create(model="tiny", prompt="ok",
                                     max_tokens=4).choices[0].text == "hi"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="prefill-400", max_tokens=4)
    assert e.value.body == json.loads(BAD)["error"]


def test_an_instance_that_refuses_is_skipped_and_decode_is_balanced(stack):
    """Completions with a prefill and a decode instance down (connection
    refused: a server killed) among live ones: every request is served by
    a live instance, the two live decode instances take turns, and the
    router says it skipped the dead ones."""
    import requests

    from vllm_patch.launch.router import ProxyThread
    from vllm_patch.launch.supervisor import free_port

    prefill, decode = stack[0].instances
    seen: list = []
    decode2 = Served(fake_instance("decode2", seen))
    dead_p, dead_d = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    router = ProxyThread([dead_p, prefill], [dead_d, decode, decode2.url])
    try:
        before = len(stack[1])
        for i in range(6):
            r = requests.post(router.url + "/v1/completions",
                              json={"model": "tiny", "prompt": f"p{i}"}, timeout=30)
            assert r.status_code == 200, r.text
        # decode2 served about half (round robin over the live two)
        served2 = [b["prompt"] for role, _, b in seen if role == "decode2"]
        served1 = [b["prompt"] for role, path, b in stack[1][before:]
                   if role == "decode" and path == "/v1/completions"]
        assert len(served1) + len(served2) == 6 and 2 <= len(served2) <= 4, \
            (served1, served2)
        assert router.router.counts["skipped"] >= 2
        assert router.router.counts["prefill_errors"] == 0
    finally:
        router.stop()
        decode2.stop()


def test_a_decode_instance_lost_mid_stream_ends_with_an_error_event(stack):
    """A decode server that dies mid-stream (its connection cut before the
    stream's end): the client gets an OpenAI-format error event, on which
    the official openai client raises APIError, not a stream that just
    stops and looks finished."""
    import openai
    from aiohttp import web

    from vllm_patch.launch.router import ProxyThread

    async def dying(request):
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        chunk = {"id": "c", "object": "text_completion", "created": 0, "model": "tiny",
                 "choices": [{"index": 0, "text": "he", "finish_reason": None,
                              "logprobs": None}]}
        await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await asyncio.sleep(0.2)
        request.transport.close()  # the server killed: no end of the chunked body
        return out

    app = web.Application()
    app.router.add_post("/v1/completions", dying)
    dec = Served(app)
    router = ProxyThread([stack[0].instances[0]], [dec.url])
    try:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0,
                               timeout=30)
        text = ""
        with pytest.raises(openai.APIError) as e:
            for ev in client.completions.create(model="tiny", prompt="x", max_tokens=8,
                                                stream=True):
                text += ev.choices[0].text
        assert text == "he"
        assert e.value.body["type"] == "BadGatewayError", e.value.body
        assert "mid-stream" in e.value.message
    finally:
        router.stop()
        dec.stop()


def test_a_role_with_no_instance_left_is_openai_503(stack):
    """The launcher lost a role's last instance and is starting it again
    (set_instances with none of that role, the lost one kept for /health):
    every request gets a clean 503 at once (before: an exception in the
    router, a 500), /health says 503 with the lost instance, and the
    router serves again once the instance is back."""
    import requests

    from vllm_patch.launch.router import ProxyThread

    router, _ = stack
    prefill, decode = router.instances
    lone = ProxyThread([prefill], [decode])
    try:
        for gone, (p, d) in (("prefill", ([], [decode])), ("decode", ([prefill], []))):
            lone.set_instances(p, d, [prefill if gone == "prefill" else decode])
            time.sleep(0.3)  # applied in the router's own loop
            for method, path, body in (("POST", "/v1/completions", {"prompt": "a"}),
                                       ("POST", "/v1/chat/completions",
                                        {"messages": [{"role": "user", "content": "a"}]}),
                                       ("GET", "/v1/models", None),
                                       ("GET", "/v1/models/tiny", None)):
                if gone == "prefill" and method == "GET":
                    continue  # read-only requests go to a decode instance
                t0 = time.monotonic()
                r = requests.request(method, lone.url + path, json=body, timeout=30)
                err = _openai_error(r, 503)
                assert err["type"] == "ServiceUnavailableError", (gone, path)
                assert f"no {gone} instance is serving" in err["message"]
                assert time.monotonic() - t0 < 2
            h = requests.get(lone.url + "/health", timeout=30)
            assert h.status_code == 503
        lone.set_instances([prefill], [decode])
        time.sleep(0.3)
        r = requests.post(lone.url + "/v1/completions", json={"prompt": "a"}, timeout=30)
        assert r.status_code == 200, r.text
        assert requests.get(lone.url + "/health", timeout=30).status_code == 200
    finally:
        lone.stop()


def _closes_kept_connections(role: str, seen: list):
    """A stand-in that closes a connection which already served a request
    when the next request arrives on it, unanswered: what the router meets
    when an instance's keep-alive timer closes an idle connection just as
    a request is written into it (vLLM's server closes one after 5 s idle;
    on a loaded host the router can still take it for a live one)."""
    from aiohttp import web

    served: list = []  # the connections' handlers (kept: an id may be reused)

    def closed(request) -> bool:
        """A kept connection: closed unanswered (True); else remembered."""
        if any(p is request.protocol for p in served):
            seen.append((role, "closed"))
            request.transport.close()
            return True
        served.append(request.protocol)
        return False

    async def completions(request):
        if closed(request):
            return web.Response()  # never reaches the router
        await request.json()
        seen.append((role, "answered"))
        body = ({"choices": [{"text": "x"}], "kv_transfer_params": {"from": role}}
                if role == "prefill" else
                {"id": "c", "object": "text_completion", "created": 0, "model": "tiny",
                 "choices": [{"index": 0, "text": "hi", "finish_reason": "stop",
                              "logprobs": None}]})
        return web.json_response(body)

    async def tokenize(request):
        if closed(request):
            return web.Response()
        await request.json()
        seen.append((role, "answered"))
        return web.json_response({"tokens": [1, 2], "count": 2, "max_model_len": 512})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/tokenize", tokenize)
    return app


def test_a_kept_connection_the_instance_closed_is_sent_again_on_a_new_one():
    """Both instances close every kept connection under the next request:
    each completion is still answered (its prefill and its decode resent
    once, on new connections, and counted), where a router that only reused
    its connections answered 502 "Server disconnected". A request that
    fails on a new connection is not sent again."""
    import requests

    from vllm_patch.launch.router import ProxyThread

    seen: list = []
    prefill = Served(_closes_kept_connections("prefill", seen))
    decode = Served(_closes_kept_connections("decode", seen))
    router = ProxyThread([prefill.url], [decode.url])
    try:
        for i in range(4):
            r = requests.post(router.url + "/v1/completions",
                              json={"model": "tiny", "prompt": f"p{i}"}, timeout=30)
            assert r.status_code == 200, (i, r.text, seen)
            assert r.json()["choices"][0]["text"] == "hi"
        # requests 1 and 3 open connections that are kept; requests 2 and 4
        # meet them closed on both sides and are resent once, on connections
        # that are not kept
        assert [e for _, e in seen].count("answered") == 8, seen
        assert [e for _, e in seen].count("closed") == 4, seen
        assert router.router.counts["stale_retries"] == 4
        # a read-only request (POST /tokenize, to the decode instance) alike
        seen.clear()
        for i in range(4):
            r = requests.post(router.url + "/tokenize",
                              json={"model": "tiny", "prompt": f"t{i}"}, timeout=30)
            assert r.status_code == 200, (i, r.text, seen)
            assert r.json()["count"] == 2
        assert [e for _, e in seen].count("answered") == 4, seen
        assert [e for _, e in seen].count("closed") == 2, seen
        assert router.router.counts["stale_retries"] == 4 + 2
    finally:
        router.stop()
        decode.stop()
        prefill.stop()

    # an instance that drops every request, on new connections too: one
    # resend at most, then the client's 502
    from aiohttp import web

    tries: list = []

    async def drop(request):
        tries.append(request.protocol)
        request.transport.close()
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", drop)
    dead = Served(app)
    prefill = Served(fake_instance("prefill", []))
    router = ProxyThread([prefill.url], [dead.url])
    try:
        r = requests.post(router.url + "/v1/completions",
                          json={"model": "tiny", "prompt": "x"}, timeout=30)
        err = _openai_error(r, 502)
        assert "Server disconnected" in err["message"], err
        assert len(tries) == 1, tries  # a new connection: not resent
    finally:
        router.stop()
        dead.stop()
        prefill.stop()
