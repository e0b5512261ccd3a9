"""Minimal P/D router for vLLM's OpenAI server (aiohttp).

It forwards the client's JSON untouched except for the P/D fields, so every
structured-output form (and ignore_eos, return_token_ids, ...) reaches both
instances as vLLM parses it, and a 4xx from either instance (e.g. an invalid
JSON schema) reaches the client byte for byte, with its status. (The
`vllm-router` package parses requests into its own types and re-serialises
them, so a field it does not model is at its mercy, and supports only some
KV connectors.) An instance that cannot be reached is logged and answered
with 502 (504 when it does not answer in time).

Flow per POST /v1/completions or /v1/chat/completions:
1. prefill: the request with max_tokens=1 (max_completion_tokens=1 for chat),
   stream=False, no stream_options/min_tokens, and
   kv_transfer_params={"do_remote_decode": True, ...} (NixlConnector reads
   it; ExampleConnector ignores it and keys the KV by prompt hash);
2. a non-200 prefill answer is returned to the client unchanged;
3. decode: the original request plus the kv_transfer_params the prefill
   instance returned (if any); streaming is passed through chunk by chunk.
   A client disconnect closes the decode connection, so vLLM aborts there.
   A decode instance that goes away mid-stream ends the stream with an
   OpenAI-format error event (`data: {"error": {...}}`, as vLLM's server
   writes its own; the openai client raises APIError on it), never with a
   silent end the client would take for a finished answer.

Several instances of a role: round robin. An instance the router cannot
connect to (connection refused, or no connection within CONNECT_TIMEOUT_S:
its server killed, its node down or cut off) is skipped for DOWN_S and the
request goes to the next one (nothing was sent, so nothing runs twice);
with one instance left, the router waits for it as long as the request's
own timeout (a short partition then only delays the request).

Connections to the instances are kept for reuse (KEEPALIVE_S). An instance
may close an idle one just as the router writes a request into it (its
keep-alive timer firing while the router's answer to the previous request
is still on its way, more likely on a loaded host): the request then meets
"Server disconnected" before any answer. Such a request, on a reused
connection with no answer begun, is sent once more on a new connection to
the same instance (counted as `stale_retries`), as HTTP clients such as
Go's do for a closed idle connection; a request that fails on a new
connection is not sent again (the instance itself failed). The same for
the read-only endpoints (they only read: also when an answer had begun).

GET /health: 200 when every instance answers /health with 200 within
HEALTH_TIMEOUT_S; else 503; the body maps each instance to its status (599:
no answer). An instance the launcher reports lost (set_instances) stays in
it until it rejoins: 503 meanwhile, while the others serve.
GET /metrics: the instances' metrics, each line labelled pd_role="prefill|decode"
(an instance that does not answer within METRICS_TIMEOUT_S is left out).

The read-only endpoints of vLLM's OpenAI server are forwarded to a decode
instance (round robin; the next one if an instance cannot be reached) and
its answer, status included, is passed through: GET /v1/models, GET
/version, POST /tokenize, POST /detokenize, GET /tokenizer_info (served by
vLLM only with --enable-tokenizer-info-endpoint: a 404 otherwise). GET
/v1/models/{model} (the openai client's `models.retrieve`; vLLM's server
has no such route) answers the model's entry from the decode instance's
/v1/models, or vLLM's 404 for an unknown model.

Every error the router makes itself is in OpenAI's format, with the fields
vLLM's server gives its own errors: {"error": {"message", "type", "param",
"code"}}, `type` the HTTP phrase unless more is known; an unknown path is a
404, a known path with the wrong method a 405 (with an Allow header). (vLLM
0.32's server itself answers those two with FastAPI's {"detail": ...}.)

    python -m vllm_patch.launch.router --prefill http://127.0.0.1:8100 \
        --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import logging
import threading
import uuid
from http import HTTPStatus

from aiohttp import (ClientConnectorError, ClientError, ClientOSError, ClientSession,
                     ClientTimeout, ConnectionTimeoutError, ServerDisconnectedError,
                     TCPConnector, TraceConfig, web)

from vllm_patch.launch.supervisor import free_port

logger = logging.getLogger(__name__)

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_FORWARD_HEADERS = ("authorization", "x-request-id")
# vLLM OpenAI-server endpoints that only read: answered by a decode instance.
READ_ONLY = (("GET", "/v1/models"), ("GET", "/version"), ("POST", "/tokenize"),
             ("POST", "/detokenize"), ("GET", "/tokenizer_info"))
READ_TIMEOUT_S = 60.0
# An instance's /health answers in milliseconds; one that does not answer
# in this long is down or cut off.
HEALTH_TIMEOUT_S = 3.0
# Seconds an idle connection to an instance is kept for reuse: below the 5 s
# after which vLLM's server (uvicorn, VLLM_HTTP_TIMEOUT_KEEP_ALIVE) closes an
# idle one, so a request is rarely written into a connection the server is
# closing or has closed (aiohttp's default keeps them 15 s). Rarely, not
# never: the router's clock can lag the server's (a loaded host), and a
# partition loses the server's close with the link; such a request is sent
# again on a new connection (_post).
KEEPALIVE_S = 3.0
METRICS_TIMEOUT_S = 5.0
# With another instance of the role to try: how long to wait for a TCP
# connection before trying it (a LAN connects in milliseconds; a node cut
# off never answers the SYN), and how long an instance that could not be
# connected to is tried last.
CONNECT_TIMEOUT_S = 3.0
DOWN_S = 10.0
# request key: the streamed response, once started
_STREAMING = (web.RequestKey("pd_streaming", web.StreamResponse)
              if hasattr(web, "RequestKey") else "pd_streaming")  # aiohttp < 3.13


def error_response(status: int, message: str, type_: str | None = None,
                   param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    """An error in OpenAI's format, as vLLM's server writes it (`type` is
    the HTTP phrase unless given, `code` the status)."""
    return web.json_response(
        {"error": {"message": message, "type": type_ or HTTPStatus(status).phrase,
                   "param": param, "code": status}},
        status=status, headers=headers)


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own errors (no route: 404, wrong method: 405, body too
    large: 413, ...) and anything a handler did not expect, as OpenAI-format
    JSON instead of aiohttp's plain text."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        what = f"{request.method} {request.path}"
        if isinstance(e, web.HTTPMethodNotAllowed):
            what += f" (allowed: {', '.join(sorted(e.allowed_methods))})"
        return error_response(e.status, f"{e.reason}: {what}", headers=headers)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        if request.get(_STREAMING) is not None:  # the answer has begun: keep it
            raise
        logger.exception("router error on %s %s", request.method, request.path)
        return error_response(500, f"router error: {type(e).__name__}: {e}",
                              type_="InternalServerError")


def prefill_body(body: dict, chat: bool) -> dict:
    p = copy.deepcopy(body)
    p["max_tokens"] = 1
    if chat and "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    for k in ("stream_options", "min_tokens"):
        p.pop(k, None)
    p["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return p


def decode_body(body: dict, kv_transfer_params: dict | None) -> dict:
    d = dict(body)
    if kv_transfer_params:
        d["kv_transfer_params"] = kv_transfer_params
    else:
        d.pop("kv_transfer_params", None)
    return d


async def _mark_reused(session, ctx, params) -> None:
    """aiohttp trace hook: the request goes out on a kept connection."""
    if isinstance(ctx.trace_request_ctx, dict):
        ctx.trace_request_ctx["reused"] = True


class Router:
    def __init__(self, prefill: list[str], decode: list[str],
                 timeout_s: float = 600.0) -> None:
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self._p = itertools.count()
        self._d = itertools.count()
        # instance url -> when the router last failed to connect to it
        self.down: dict[str, float] = {}
        self.lost: list[str] = []
        self._r = itertools.count()  # round robin of read-only requests
        self.timeout = ClientTimeout(total=timeout_s)
        self.session: ClientSession | None = None
        # new connections only: the one resend of a request whose reused
        # connection the instance had closed
        self.fresh: ClientSession | None = None
        self.counts = {"requests": 0, "prefill_errors": 0, "decode_errors": 0,
                       "skipped": 0, "stale_retries": 0}

    def set_instances(self, prefill: list[str], decode: list[str],
                      lost: list[str] = ()) -> None:
        """Replace the instances (in the router's event loop: see
        ProxyThread.set_instances); `lost`: instances no request goes to
        that /health still reports (the deployment is not whole)."""
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self.lost = [u.rstrip("/") for u in lost]

    def _order(self, urls: list[str], counter: itertools.count) -> list[str]:
        """The instances to try, round robin; those the router could not
        connect to in the last DOWN_S last."""
        i = next(counter) % len(urls)
        order = urls[i:] + urls[:i]
        now = asyncio.get_running_loop().time()
        up = [u for u in order if now - self.down.get(u, -DOWN_S) >= DOWN_S]
        return up + [u for u in order if u not in up]

    async def _post(self, urls: list[str], path: str, body: dict, headers: dict):
        """POST to the first instance of `urls` that takes the connection:
        (url, response) with the response entered (exit it). An instance
        that refuses, or does not connect within CONNECT_TIMEOUT_S while
        another is left to try, is marked down and skipped; the last one
        is given the request's whole timeout. Raises the last error."""
        assert self.session is not None and self.fresh is not None
        for n, url in enumerate(urls):
            last = n == len(urls) - 1
            timeout = self.timeout if last else ClientTimeout(
                total=self.timeout.total, sock_connect=CONNECT_TIMEOUT_S)
            # a kept connection first; a new one if the instance had closed it
            for session in (self.session, self.fresh):
                reuse: dict = {}
                cm = session.post(url + path, json=body, headers=headers,
                                  timeout=timeout, trace_request_ctx=reuse)
                try:
                    return url, cm, await cm.__aenter__()
                except (ClientConnectorError, ConnectionTimeoutError) as e:
                    # not connected: the request never reached the instance
                    self.down[url] = asyncio.get_running_loop().time()
                    if last:
                        raise
                    self.counts["skipped"] += 1
                    logger.warning("P/D: cannot connect to %s (%s: %s); trying %s",
                                   url, type(e).__name__, e, urls[n + 1])
                    break
                except (ServerDisconnectedError, ClientOSError) as e:
                    if not self._stale(session, reuse, e, url):
                        raise
        raise AssertionError("no instance")  # urls is never empty

    def _stale(self, session: ClientSession, reuse: dict, e: BaseException,
               url: str) -> bool:
        """Did `e` meet a kept connection the instance had closed as idle
        while the request was on its way (the request goes once more, on a
        new connection: counted and logged here)? Not for a new connection,
        nor for a connection that was never made."""
        if session is self.fresh or not reuse.get("reused") \
                or isinstance(e, ClientConnectorError) \
                or not isinstance(e, (ServerDisconnectedError, ClientOSError)):
            return False
        self.counts["stale_retries"] += 1
        logger.info("P/D: %s closed a kept connection under the request (%s: %s); "
                    "sending it again on a new connection", url, type(e).__name__, e)
        return True

    async def start(self, app: web.Application) -> None:
        reuse = TraceConfig()
        reuse.on_connection_reuseconn.append(_mark_reused)
        self.session = ClientSession(timeout=self.timeout, trace_configs=[reuse],
                                     connector=TCPConnector(keepalive_timeout=KEEPALIVE_S))
        self.fresh = ClientSession(timeout=self.timeout,
                                   connector=TCPConnector(force_close=True))

    async def close(self, app: web.Application) -> None:
        for session in (self.session, self.fresh):
            if session is not None:
                await session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20, middlewares=[openai_errors])
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.close)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        for method, path in READ_ONLY:
            app.router.add_route(method, path, self.read_only)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._pd(request, "/v1/completions", chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._pd(request, "/v1/chat/completions", chat=True)

    async def _pd(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        try:
            return await self._pd_inner(request, path, chat)
        except (ClientError, asyncio.TimeoutError) as e:
            # an instance is down, went away mid-request or did not answer in
            # time; or the client went away mid-stream (the answer has begun:
            # end it as it is)
            started = request.get(_STREAMING)
            if started is not None:
                return started
            return self._upstream_error(path, e)

    def _upstream_error(self, path: str, e: BaseException) -> web.Response:
        self.counts["upstream_errors"] = self.counts.get("upstream_errors", 0) + 1
        logger.warning("P/D upstream error on %s: %s: %s", path, type(e).__name__, e)
        if isinstance(e, asyncio.TimeoutError):
            return error_response(504, f"P/D upstream timeout on {path}",
                                  type_="GatewayTimeoutError")
        return error_response(502, f"P/D upstream error: {type(e).__name__}: {e}",
                              type_="BadGatewayError")

    async def _pd_inner(self, request: web.Request, path: str,
                        chat: bool) -> web.StreamResponse:
        assert self.session is not None
        self.counts["requests"] += 1
        raw = await request.read()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("request body must be a JSON object")
        except ValueError as e:
            return error_response(400, f"invalid JSON body: {e}", type_="BadRequestError")
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
        headers.setdefault("X-Request-Id", f"pd-{uuid.uuid4().hex}")
        for role, urls in (("prefill", self.prefill), ("decode", self.decode)):
            if not urls:  # its last instance lost: the launcher starts it again
                return self._none_serving(role)

        # 1. prefill
        url, cm, resp = await self._post(self._order(self.prefill, self._p), path,
                                         prefill_body(body, chat), headers)
        try:
            pbytes = await resp.read()
            if resp.status != 200:
                self.counts["prefill_errors"] += 1
                return web.Response(status=resp.status, body=pbytes,
                                    content_type=resp.content_type)
        finally:
            await cm.__aexit__(None, None, None)
        try:
            kv_params = json.loads(pbytes).get("kv_transfer_params")
        except ValueError:
            kv_params = None

        # 2. decode: the original request (+ params); stream passed through
        url, cm, resp = await self._post(self._order(self.decode, self._d), path,
                                         decode_body(body, kv_params), headers)
        try:
            if resp.status != 200 or not body.get("stream"):
                data = await resp.read()
                if resp.status != 200:
                    self.counts["decode_errors"] += 1
                return web.Response(status=resp.status, body=data,
                                    content_type=resp.content_type)
            out = web.StreamResponse(status=200, headers={
                "Content-Type": resp.headers.get("Content-Type", "text/event-stream")})
            request[_STREAMING] = out
            await out.prepare(request)
            chunks = resp.content.iter_any()
            while True:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                except (ClientError, asyncio.TimeoutError) as e:
                    # the decode instance went away mid-stream: say so in
                    # the stream, as vLLM's server reports its own errors
                    self.counts["decode_errors"] += 1
                    logger.warning("P/D: decode instance %s failed mid-stream: %s: %s",
                                   url, type(e).__name__, e)
                    event = {"error": {
                        "message": f"P/D upstream error: the decode instance failed "
                                   f"mid-stream ({type(e).__name__}: {e})",
                        "type": "BadGatewayError", "param": None, "code": 502}}
                    await out.write(
                        f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())
                    break
                await out.write(chunk)  # raises on client disconnect -> closes resp
            await out.write_eof()
            return out
        finally:
            await cm.__aexit__(None, None, None)

    def _none_serving(self, role: str) -> web.Response:
        self.counts["unavailable"] = self.counts.get("unavailable", 0) + 1
        return error_response(503, f"P/D: no {role} instance is serving now (the "
                              "launcher is starting one again): retry later",
                              type_="ServiceUnavailableError")

    def _decode_order(self) -> list[str]:
        i = next(self._r) % len(self.decode)
        return self.decode[i:] + self.decode[:i]

    async def _read_only(self, request: web.Request, path_qs: str,
                         method: str | None = None) -> tuple[int, bytes, str]:
        """The request sent to a decode instance: (status, body, content type).
        Tries the next instance when one cannot be reached (the request only
        reads); raises the last error when none can."""
        assert self.session is not None
        raw = await request.read()
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in _FORWARD_HEADERS + ("content-type",)}
        assert self.fresh is not None
        err: BaseException | None = None
        for url in self._decode_order():
            # a kept connection first; a new one if the instance had closed it
            for session in (self.session, self.fresh):
                reuse: dict = {}
                try:
                    async with session.request(
                            method or request.method, url + path_qs, data=raw or None,
                            headers=headers, timeout=ClientTimeout(total=READ_TIMEOUT_S),
                            trace_request_ctx=reuse) as r:
                        return (r.status, await r.read(),
                                r.headers.get("Content-Type", "application/json"))
                except (ClientError, asyncio.TimeoutError) as e:
                    err = e
                    if not self._stale(session, reuse, e, url):
                        break  # the next instance
        assert err is not None
        raise err

    async def read_only(self, request: web.Request) -> web.Response:
        """A read-only vLLM endpoint, answered by a decode instance as is."""
        if not self.decode:
            return self._none_serving("decode")
        try:
            status, body, ctype = await self._read_only(request, request.path_qs)
        except (ClientError, asyncio.TimeoutError) as e:
            return self._upstream_error(request.path, e)
        return web.Response(status=status, body=body, headers={"Content-Type": ctype})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model}: the entry of /v1/models (OpenAI's
        retrieve-model call; vLLM's server has no such route)."""
        name = request.match_info["model"]
        if not self.decode:
            return self._none_serving("decode")
        try:
            status, body, ctype = await self._read_only(request, "/v1/models", "GET")
        except (ClientError, asyncio.TimeoutError) as e:
            return self._upstream_error(request.path, e)
        if status != 200:
            return web.Response(status=status, body=body, headers={"Content-Type": ctype})
        for card in json.loads(body).get("data", []):
            if card.get("id") == name:
                return web.json_response(card)
        return error_response(404, f"The model `{name}` does not exist.",
                              type_="NotFoundError", param="model")

    async def _get(self, url: str, timeout_s: float) -> tuple[int, str]:
        assert self.session is not None
        try:
            async with self.session.get(url, timeout=ClientTimeout(total=timeout_s)) as r:
                return r.status, await r.text()
        except (OSError, asyncio.TimeoutError) as e:
            return 599, str(e) or f"no answer within {timeout_s:g} s"

    async def health(self, request: web.Request) -> web.Response:
        """Every instance asked at once, each given HEALTH_TIMEOUT_S: an
        instance that does not answer (a node cut off) reads 599, and the
        router answers 503 well within a client's usual 10 s."""
        urls = self.prefill + self.decode + self.lost
        res = await asyncio.gather(*(self._get(u + "/health", HEALTH_TIMEOUT_S)
                                     for u in urls))
        # a lost instance (the launcher starts it again) keeps it 503 even
        # when its address answers: the router sends it nothing yet
        ok = (all(s == 200 for s, _ in res) and not self.lost
              and bool(self.prefill) and bool(self.decode))
        return web.json_response({u: s for u, (s, _) in zip(urls, res)},
                                 status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        """Every instance's metrics, labelled with its role and index, asked
        at once (METRICS_TIMEOUT_S each: within a Prometheus scrape's
        default 10 s even when an instance does not answer)."""
        which = [(role, i, u) for role, urls in (("prefill", self.prefill),
                                                  ("decode", self.decode))
                 for i, u in enumerate(urls)]
        res = await asyncio.gather(*(self._get(u + "/metrics", METRICS_TIMEOUT_S)
                                     for _, _, u in which))
        parts = [label_metrics(text, role, i)
                 for (role, i, _), (s, text) in zip(which, res) if s == 200]
        return web.Response(text="\n".join(parts), content_type="text/plain")


def label_metrics(text: str, role: str, index: int) -> str:
    lab = f'pd_role="{role}",pd_index="{index}"'
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition(" ")
        if "{" in name:
            name = name.replace("{", "{" + lab + ",", 1)
        else:
            name = name + "{" + lab + "}"
        out.append(f"{name} {rest}")
    return "\n".join(out)


def make_app(prefill: list[str], decode: list[str]) -> web.Application:
    return Router(prefill, decode).app()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", action="append", required=True)
    ap.add_argument("--decode", action="append", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    web.run_app(make_app(a.prefill, a.decode), host=a.host, port=a.port,
                access_log=None)



def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: sum over label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


class ProxyThread:
    """The proxy (on an ephemeral port unless given), in a daemon thread with
    its own event loop."""

    def __init__(self, prefill: list[str], decode: list[str], host: str = "127.0.0.1",
                 port: int | None = None) -> None:
        self.router = Router(prefill, decode)
        self.port = port or free_port()
        self.url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner = web.AppRunner(self.router.app(), access_log=None)

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, host, self.port)
            try:
                self._loop.run_until_complete(site.start())
            except OSError as e:
                self.error = e
                self._ready.set()
                return
            self._ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True, name="pd-proxy")
        self.error: OSError | None = None
        self._thread.start()
        self._ready.wait(30)
        if self.error is not None:
            raise RuntimeError(f"router cannot listen on {host}:{self.port}: {self.error}")

    def set_instances(self, prefill: list[str], decode: list[str],
                      lost: list[str] = ()) -> None:
        """Replace the instances the router sends requests to (an instance
        restarted at another address, one gone for good); `lost` ones are
        only in /health, which answers 503 while there are any."""
        self._loop.call_soon_threadsafe(self.router.set_instances, prefill, decode,
                                        list(lost))

    def stop(self) -> None:
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        try:
            fut.result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


if __name__ == "__main__":
    main()
