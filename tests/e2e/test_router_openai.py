"""The P/D router's OpenAI surface, with the official `openai` client, in front
of a real P/D pair of vLLM 0.32 OpenAI servers (ExampleConnector, the tiny
local model, xgrammar with disable_any_whitespace, no speculative decoding:
this is about the HTTP surface, not a guarantee). One pair serves every case.

Checks: models.list / models.retrieve give the decode instance's model id;
completions and chat, streaming and not (greedy: the streamed text equals
the whole answer); structured outputs with a real JSON schema from
JSONSchemaBench (`structured_outputs` and `response_format`), valid and
finished; a schema the grammar backend rejects gets the instance's 400 as it
is; /version, /tokenize -> /detokenize round trip equal to the decode
instance's own answers; an unknown path -> openai.NotFoundError with an
OpenAI-format body (vLLM's own server answers {"detail": "Not Found"} there);
a wrong method -> 405. Runs the same patched and stock.

    python -m pytest tests/e2e/test_router_openai.py -m e2e -q -s
"""

from __future__ import annotations

import json
import re

import pytest

from vllm_patch.testing import jsonschemabench

# the first test also waits for the pair to start (minutes on a busy 2-core
# machine); every request below has its own client timeout
pytestmark = [pytest.mark.e2e, pytest.mark.patched_only, pytest.mark.timeout(900)]

SCHEMAS = jsonschemabench.SCHEMAS
GOOD = "Github_trivial/o43979.json"   # FirmwareStatusNotificationRequest: a required enum
GOOD2 = "Github_trivial/o41662.json"  # a required 10-character string, through a $ref
REJECTED = "Github_trivial/o25192.json"  # minItems without items: xgrammar refuses it


def schema(name: str) -> dict:
    path = SCHEMAS / name
    if not path.exists():
        pytest.skip(jsonschemabench.MISSING)
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    from vllm_patch.testing.pd_pair import PDConfig, PDPair

    storage = tmp_path_factory.mktemp("pd-router")
    with PDPair(PDConfig(storage=str(storage), spec_k=None, start_timeout_s=600)) as pair:
        print(f"\nROUTER-E2E pair up in {pair.start_s:.0f}s")
        yield pair


@pytest.fixture(scope="module")
def client(pd):
    import openai

    return openai.OpenAI(base_url=pd.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _prompt(i: int) -> str:
    from vllm_patch.testing import workload as wl

    return wl.prompt(3000 + i)


def test_models(pd, client):
    import requests

    direct = requests.get(pd.server("decode").url + "/v1/models", timeout=30).json()
    ids = [m.id for m in client.models.list()]
    assert ids == [m["id"] for m in direct["data"]] == ["tiny"]
    m = client.models.retrieve("tiny")
    assert (m.id, m.object, m.owned_by) == ("tiny", "model", "vllm")
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["param"] == "model" and e.value.body["code"] == 404


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_generate_stream_and_not(client, chat):
    kw = dict(model="tiny", max_tokens=12, temperature=0)
    if chat:
        msgs = [{"role": "user", "content": _prompt(1)}]
        whole = client.chat.completions.create(messages=msgs, **kw)
        text, finish = whole.choices[0].message.content, whole.choices[0].finish_reason
        chunks = [c for c in client.chat.completions.create(messages=msgs, stream=True, **kw)
                  if c.choices]
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        whole = client.completions.create(prompt=_prompt(0), **kw)
        text, finish = whole.choices[0].text, whole.choices[0].finish_reason
        chunks = [c for c in client.completions.create(prompt=_prompt(0), stream=True, **kw)
                  if c.choices]
        streamed = "".join(c.choices[0].text for c in chunks)
    print(f"\nROUTER-E2E {'chat' if chat else 'completions'}: {finish} {text!r}")
    assert whole.model == "tiny" and whole.usage.completion_tokens > 0
    assert text and streamed == text
    assert len(chunks) > 1
    assert chunks[-1].choices[0].finish_reason == finish


FORMS = [("completions+structured_outputs", False), ("completions+structured_outputs", True),
         ("chat+response_format", False), ("chat+response_format", True),
         ("chat+structured_outputs", False)]


@pytest.mark.parametrize("form,stream", FORMS)
@pytest.mark.parametrize("name", [GOOD, GOOD2])
def test_structured_json_schema(client, name, form, stream):
    import jsonschema

    s = schema(name)
    kw = dict(model="tiny", max_tokens=64, temperature=0, stream=stream)
    i = [GOOD, GOOD2].index(name) * 10 + [f for f, _ in FORMS].index(form)
    if form.startswith("completions"):
        out = client.completions.create(prompt=_prompt(10 + i), **kw,
                                        extra_body={"structured_outputs": {"json": s}})
        get = (lambda c: c.text)
    else:
        msgs = [{"role": "user", "content": _prompt(10 + i)}]
        if form == "chat+response_format":
            out = client.chat.completions.create(messages=msgs, **kw, response_format={
                "type": "json_schema", "json_schema": {"name": "s", "schema": s}})
        else:
            out = client.chat.completions.create(messages=msgs, **kw,
                                                 extra_body={"structured_outputs": {"json": s}})
        get = ((lambda c: c.delta.content) if stream else (lambda c: c.message.content))
    if stream:
        chunks = [c for c in out if c.choices]
        text = "".join(get(c.choices[0]) or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        text, finish = get(out.choices[0]), out.choices[0].finish_reason
    print(f"\nROUTER-E2E {name} {form} stream={stream}: {finish} {text!r}")
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), s)


def test_rejected_schema_is_the_instance_400(pd, client):
    import openai
    import requests

    s = schema(REJECTED)
    body = {"model": "tiny", "prompt": _prompt(2), "max_tokens": 8,
            "structured_outputs": {"json": s}}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=_prompt(2), max_tokens=8,
                                  extra_body={"structured_outputs": {"json": s}})
    direct = requests.post(pd.server("decode").url + "/v1/completions", json=body, timeout=60)
    assert direct.status_code == 400
    untimed = (lambda m: re.sub(r"\[\d\d:\d\d:\d\d\] ", "", m))
    assert untimed(e.value.body["message"]) == untimed(direct.json()["error"]["message"])
    print(f"\nROUTER-E2E rejected schema: 400 {e.value.body['message'][:100]!r}")


def test_read_only_endpoints(pd):
    import requests

    d = pd.server("decode").url
    assert requests.get(pd.url + "/version", timeout=30).json() == \
        requests.get(d + "/version", timeout=30).json()
    text = "The router forwards this to the decode instance."
    tok = requests.post(pd.url + "/tokenize", json={"model": "tiny", "prompt": text},
                        timeout=30)
    assert tok.status_code == 200, tok.text
    assert tok.json() == requests.post(d + "/tokenize", json={"model": "tiny", "prompt": text},
                                       timeout=30).json()
    tokens = tok.json()["tokens"]
    assert tokens and tok.json()["count"] == len(tokens)
    detok = requests.post(pd.url + "/detokenize", json={"model": "tiny", "tokens": tokens},
                          timeout=30)
    assert detok.status_code == 200, detok.text
    assert detok.json()["prompt"].strip() == text
    # not served by the instances (vLLM serves it only with
    # --enable-tokenizer-info-endpoint): their status passed through
    via = requests.get(pd.url + "/tokenizer_info", timeout=30)
    assert via.status_code == requests.get(d + "/tokenizer_info", timeout=30).status_code == 404


def test_unknown_path_and_wrong_method(pd, client):
    import openai
    import requests

    with pytest.raises(openai.NotFoundError) as e:
        client.files.list()  # an OpenAI API vLLM does not serve
    assert e.value.status_code == 404
    assert e.value.body == {"message": "Not Found: GET /v1/files", "type": "Not Found",
                            "param": None, "code": 404}
    vllm_own = requests.get(pd.server("decode").url + "/v1/files", timeout=30)
    print(f"\nROUTER-E2E unknown path: router {e.value.body}; vLLM's own server "
          f"{vllm_own.status_code} {vllm_own.text}")
    r = requests.get(pd.url + "/v1/chat/completions", timeout=30)
    assert r.status_code == 405 and r.headers["Allow"] == "POST"
    assert r.json()["error"]["type"] == "Method Not Allowed"
