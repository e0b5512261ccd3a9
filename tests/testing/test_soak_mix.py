"""The soak's generator, checkers and differential table
(vllm_patch.testing.soak), without a server: the seeded mix covers what it
claims and is reproducible; the replay through the real grammar backends
finds tokens after the grammar's end and refused tokens; the text checks
and the stock/patched diff classify failures as the report says.

    python -m pytest tests/testing/test_soak_mix.py -q
"""

from __future__ import annotations

import collections
import json

import pytest

from vllm_patch.testing import jsonschemabench, soak

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def schemas():
    s = soak.load_schemas()
    if not s:
        pytest.skip(f"no schema at {soak.SCHEMAS}: {jsonschemabench.MISSING}")
    return s


@pytest.fixture(scope="module")
def stream(schemas):
    return [soak.make_request(7, i, schemas) for i in range(300)]


def test_stream_is_seeded_and_independent_per_request(schemas, stream):
    again = soak.make_request(7, 123, schemas)
    assert json.dumps(again, sort_keys=True) == json.dumps(stream[123], sort_keys=True)
    assert soak.make_request(8, 123, schemas) != stream[123]
    assert [soak.concurrency(7, i) for i in range(0, 300, 16)] == \
        [soak.concurrency(7, i) for i in range(0, 300, 16)]
    levels = {soak.concurrency(7, i) for i in range(0, 3000, 16)}
    assert levels == {1, 2, 4, 8, 16, 32}


def test_stream_covers_the_production_mix(stream):
    kinds = collections.Counter(r["kind"] for r in stream)
    assert set(kinds) == {"schema", "json_object", "regex", "choice", "grammar", "plain"}
    bodies = [r["body"] for r in stream]
    extra = [b["extra_body"] for b in bodies]
    assert {r["api"] for r in stream} == {"chat", "completions"}
    assert {b["temperature"] for b in bodies} == {0.0, 0.7, 1.0}
    assert any("seed" in b for b in bodies) and any(b["temperature"] and "seed" not in b
                                                    for b in bodies)
    for key in ("top_p", "presence_penalty", "logprobs", "n", "stop"):
        assert any(key in b for b in bodies), key
    for key in ("min_p", "repetition_penalty", "stop_token_ids", "min_tokens"):
        assert any(key in e for e in extra), key
    assert any(b.get("top_logprobs") is not None for b in bodies)
    assert {e["ignore_eos"] for e in extra} == {True, False}
    assert {b["stream"] for b in bodies} == {True, False}
    assert any(r["disconnect"] for r in stream)
    assert any(b.get("response_format", {}).get("type") == "json_schema" for b in bodies)
    maxes = [b["max_tokens"] for b in bodies]
    assert min(maxes) <= 4 and max(maxes) > 64
    plens = [len(b["prompt"]) for b in bodies if isinstance(b.get("prompt"), list)]
    assert 1 in plens and max(plens) > soak.MAX_MODEL_LEN - 100
    for b in bodies:  # never over the model's length
        if isinstance(b.get("prompt"), list):
            assert len(b["prompt"]) + b["max_tokens"] <= soak.MAX_MODEL_LEN
    # n > 1 only when sampling (vLLM refuses it greedy)
    assert all(b["temperature"] for b in bodies if b.get("n", 1) > 1)
    # min_tokens <= max_tokens (vLLM refuses more)
    assert all(e["min_tokens"] <= b["max_tokens"] for b, e in zip(bodies, extra)
               if "min_tokens" in e)


def test_top_k_left_out_with_spec_decoding_unless_asked(schemas):
    with_spec = [soak.make_request(7, i, schemas) for i in range(200)]
    no_spec = [soak.make_request(7, i, schemas, spec_decoding=False) for i in range(200)]
    forced = [soak.make_request(7, i, schemas, known_crashes=True) for i in range(200)]
    assert not any("top_k" in r["body"]["extra_body"] for r in with_spec)
    assert any("top_k" in r["body"]["extra_body"] for r in no_spec)
    assert [r["body"]["extra_body"].get("top_k") for r in no_spec] == \
        [r["body"]["extra_body"].get("top_k") for r in forced]
    # the rest of the stream is the same
    for a, b in zip(with_spec, no_spec):
        b["body"]["extra_body"].pop("top_k", None)
        assert a == b


def _choice_request():
    return {"id": "t-1", "kind": "choice", "api": "completions", "spec": ["yes", "no"],
            "disconnect": False,
            "body": {"max_tokens": 8, "extra_body": {"structured_outputs":
                                                     {"choice": ["yes", "no"]}}}}


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_replay_finds_tokens_after_the_grammars_end(backend):
    from vllm_patch.testing import tiny_model

    r = soak.Replayer(backend)
    req = _choice_request()
    yes = r.tok.encode("yes", add_special_tokens=False)
    eos, im_end = tiny_model.EOS, tiny_model.IM_END
    assert r.replay(req, yes + [eos]) == (0, None)
    assert r.replay(req, yes + [im_end]) == (0, None)
    assert r.replay(req, yes) == (0, None)       # cut by max_tokens
    assert r.replay(req, yes + [eos, 5, 6]) == (2, None)
    assert r.replay(req, yes + [im_end, eos]) == (1, None)
    bad = r.tok.encode("maybe", add_special_tokens=False)
    assert r.replay(req, bad)[1] == 0            # refused at once
    assert r.replay(req, yes + [5])[1] == len(yes)
    # the checker turns that into failure kinds
    out = {0: {"text": "yes", "ids": yes + [eos, 5], "finish": "length",
               "lp_rows": 0, "lp_top": 0}}
    assert soak.check_choices(req, out, r, None) == ["post_grammar"]
    out[0]["ids"] = yes + [eos]
    out[0]["finish"] = "stop"
    assert soak.check_choices(req, out, r, None) == []


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_rejected_grammar_expects_a_400(backend, schemas):
    r = soak.Replayer(backend)
    rejected = accepted = 0
    for name, s in schemas[:40]:
        req = {"id": name, "kind": "schema", "spec": name,
               "body": {"extra_body": {"structured_outputs": {"json": s}}}}
        if r.rejects(req):
            rejected += 1
            assert soak.judge(req, {"status": 400}, r, s) == []
            # a streamed request is refused by an error event carrying the 400
            assert soak.judge(req, {"status": "400-in-stream"}, r, s) == []
            assert soak.judge(req, {"status": 200, "choices": {}}, r, s) == \
                ["rejected_not_4xx"]
        else:
            accepted += 1
            assert soak.judge(req, {"status": 400}, r, s) == ["unexpected_4xx"]
    assert accepted and (rejected or backend == "guidance")
    assert soak.judge(_choice_request(), {"status": 503}, r, None) == ["http_5xx"]
    assert soak.judge(_choice_request(), {"status": None}, r, None) == ["http_error"]
    assert soak.judge(_choice_request(), {"status": "stream_error"}, r, None) == \
        ["stream_error"]


def test_text_checks():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "required": ["a"]}
    req = {"kind": "schema", "spec": "x"}
    assert soak.check_text(req, '{"a": 1}', schema) is None
    assert soak.check_text(req, '{"a": "1"}', schema) == "invalid_json"
    assert soak.check_text(req, '{"a": 1', schema) == "invalid_json"
    assert soak.check_text({"kind": "json_object"}, "[1]", None) == "invalid_json"
    assert soak.check_text({"kind": "regex", "spec": "[a-z]+-[0-9]"}, "ab-1", None) is None
    assert soak.check_text({"kind": "regex", "spec": "[a-z]+-[0-9]"}, "ab-12", None) \
        == "invalid_output"
    assert soak.check_text({"kind": "choice", "spec": ["yes"]}, "no", None) \
        == "invalid_output"


def test_logprobs_and_n_checks():
    req = {"kind": "plain", "api": "completions", "disconnect": False,
           "body": {"max_tokens": 4, "logprobs": 1, "n": 2, "extra_body": {}}}
    ok = {"text": "a", "ids": [5, 6], "finish": "length", "lp_rows": 2, "lp_top": 2}
    assert soak.check_choices(req, {0: dict(ok), 1: dict(ok)}, None, None) == []
    assert soak.check_choices(req, {0: dict(ok)}, None, None) == ["n_mismatch"]
    assert soak.check_choices(req, {0: dict(ok, lp_rows=1), 1: dict(ok)}, None, None) \
        == ["logprobs_misaligned"]
    assert soak.check_choices(req, {0: dict(ok, ids=[1] * 5, lp_rows=5), 1: dict(ok)},
                              None, None) == ["too_many_tokens"]
    assert soak.check_choices(req, {0: dict(ok, finish="error"), 1: dict(ok)},
                              None, None) == ["finish_error"]
    assert soak.refused_by_vllm({"body": {"extra_body": {"min_p": 0.1}}}, True)
    assert not soak.refused_by_vllm({"body": {"extra_body": {"min_p": 0.1}}}, False)


def test_diff_table(tmp_path):
    def write(d, recs, run_failures=()):
        d.mkdir()
        with open(d / "records.jsonl", "w") as f:
            for rid, fails in recs.items():
                f.write(json.dumps({"id": rid, "fails": fails, "finish": [],
                                    "status": 200, "request": {"api": "chat",
                                                               "body": {"n": 1}}}) + "\n")
        (d / "summary.json").write_text(json.dumps({"run_failures": list(run_failures)}))

    write(tmp_path / "s", {"0-0": ["post_grammar"], "0-1": ["http_5xx"], "0-2": [],
                           "0-3": []}, [{"kind": "kv_not_idle"}])
    write(tmp_path / "p", {"0-0": [], "0-1": ["http_5xx"], "0-2": ["invalid_json"],
                           "0-4": ["http_5xx"]}, [{"kind": "invariant_violations"}])
    d = soak.diff(tmp_path / "s", tmp_path / "p")
    assert d["compared"] == 3
    assert d["table"]["post_grammar"] == {"stock": 1, "patched": 0}
    assert d["table"]["http_5xx"] == {"stock": 1, "patched": 1}
    assert d["table"]["run:kv_not_idle"] == {"stock": 1, "patched": 0}
    assert [f["id"] for f in d["patched_only"]] == ["0-2"]
    assert [f["id"] for f in d["stock_too"]] == ["0-1"]
    assert [f["id"] for f in d["stock_only"]] == ["0-0"]
    assert d["run_patched_only"] == ["invariant_violations"]
    text = soak.format_diff(d)
    assert "patched-only failures (defects): 1" in text and "repro: chat" in text
    assert soak.main(["diff", str(tmp_path / "s"), str(tmp_path / "p")]) == 1


def test_invalid_json_the_grammar_admits_is_told_apart():
    """xgrammar compiles a `required` next to `anyOf` loosely: `{}` is the
    grammar's (every token accepted, ended on a stop token) but not the
    schema's (found by the soak: JSONSchemaBench Github_trivial/o6376)."""
    from vllm_patch.testing import tiny_model

    schema = {"anyOf": [{"properties": {"a": {"type": "string"}},
                         "additionalProperties": False},
                        {"properties": {"b": {"type": "string"}},
                         "additionalProperties": False}],
              "required": ["a"], "type": "object"}
    r = soak.Replayer("xgrammar")
    req = {"id": "t-2", "kind": "schema", "api": "completions", "spec": "x",
           "disconnect": False,
           "body": {"max_tokens": 16, "extra_body": {"structured_outputs": {"json": schema}}}}
    ids = r.tok.encode("{}", add_special_tokens=False) + [tiny_model.EOS]
    out = {0: {"text": "{}", "ids": ids, "finish": "stop", "lp_rows": 0, "lp_top": 0}}
    assert soak.check_choices(req, out, r, schema) == ["schema_looser_than_grammar"]
    bad = r.tok.encode('{"c', add_special_tokens=False)
    out[0].update(text='{"c', ids=bad)
    assert "invalid_json" in soak.check_choices(req, out, r, schema)
