"""The grammar's forced continuation as draft tokens
(`vllm_patch.v1.spec_decode.forced_drafts.forced_tokens`) on real grammars
(vLLM's xgrammar and guidance backends) and real vocabularies (the 131k
Tekken and 32k SentencePiece tokenizers of mistral_common, through vLLM's
MistralTokenizer).

Each test compares the forced drafts with the canonical tokenization of a
valid output (what a model trained on that tokenizer writes): every
returned token sequence must be a prefix of the output's next tokens (a
perfect model accepts it all), forced keys, `":"`, enum values and
constant strings are drafted, the boundary cases come back empty or cut
where the committed or the following text would merge with the forced
text, and the grammar object is left at its state.

A package function that patches nothing: patched run only.
"""

from __future__ import annotations

import pytest

from vllm_patch.testing.vocabularies import json_grammar, load_tokenizer, make_backend
from vllm_patch.v1.spec_decode.forced_drafts import (
    Outcome, forced_bytes, forced_tokens, vocab_for)

pytestmark = [pytest.mark.scheduler, pytest.mark.patched_only]

PERSON = {"type": "object",
          "properties": {"name": {"type": "string"},
                         "age": {"type": "integer"},
                         "kind": {"enum": ["alpha", "beta"]}},
          "required": ["name", "age", "kind"], "additionalProperties": False}
INSTANCE = '{"name":"John","age":42,"kind":"beta"}'

CASES = [("tekken", "xgrammar"), ("tekken", "guidance"), ("spm", "xgrammar")]


def _setup(vocab: str, backend: str, schema, whitespace: str = "none"):
    tok = load_tokenizer(vocab)
    grammar = json_grammar(make_backend(backend, tok, whitespace), schema)
    return tok, grammar


def _pieces(tok, ids):
    return [tok.convert_ids_to_tokens([i])[0] for i in ids]


def _state(grammar) -> tuple:
    """What the grammar would do next (its forced text, and whether it takes
    each of a few tokens), to check it was left where it was."""
    return (forced_bytes(grammar), grammar.is_terminated())


def _walk(tok, grammar, text, k=16):
    """Walk the canonical tokens of `text`; at each position the forced
    drafts, checked against the next tokens. Returns {position: drafts}."""
    ids = vocab_for(grammar, tok).encode_after(text)
    seen = {}
    for i, t in enumerate(ids):
        before = _state(grammar)
        ff = forced_tokens(grammar, ids[:i], tok, k)
        assert _state(grammar) == before
        assert ff == ids[i:i + len(ff)], (i, _pieces(tok, ff),
                                          _pieces(tok, ids[i:i + len(ff) + 1]))
        if ff:
            seen[i] = ff
        assert grammar.accept_tokens("t", [t]), i
    return ids, seen


@pytest.mark.parametrize("vocab,backend", CASES)
def test_forced_keys_colon_and_enum(vocab, backend):
    """Compact JSON, no whitespace: the keys, `":"` before an enum value,
    the enum's closing `"}`; every draft is what the output has next."""
    tok, grammar = _setup(vocab, backend, PERSON)
    ids, seen = _walk(tok, grammar, INSTANCE)
    pieces = _pieces(tok, ids)
    drafted = {pieces[i]: _pieces(tok, ff) for i, ff in seen.items()}
    # The keys are drafted where they start (the first one with `{"`).
    assert drafted[pieces[0]][:2] == _pieces(tok, ids[:2])
    for key in ("age", "kind"):
        assert key in drafted, drafted
    # `":"` after "kind": the enum follows, nothing can merge the quote.
    assert _pieces(tok, seen[pieces.index("kind")])[-1] == '":"', drafted
    # The enum value's end.
    assert any(p[-1] == '"}' for p in drafted.values()), drafted
    share = sum(len(ff) for ff in seen.values())
    assert share >= 6, drafted


@pytest.mark.parametrize("vocab,backend", CASES)
def test_constant_string_and_enum_value(vocab, backend):
    for schema, value in (({"const": "hello world, this is constant"},
                           '"hello world, this is constant"'),
                          ({"enum": ["alpha-long-value"]}, '"alpha-long-value"')):
        tok, grammar = _setup(vocab, backend, schema)
        ids = vocab_for(grammar, tok).encode_after(value)
        assert forced_tokens(grammar, [], tok, 32) == ids
        assert forced_tokens(grammar, [], tok, 3) == ids[:3]
        assert not grammar.validate_tokens([]) and not grammar.is_terminated()


@pytest.mark.parametrize("vocab,backend", CASES)
def test_flexible_whitespace(vocab, backend):
    """vLLM's default grammar (any whitespace): after a key's closing quote
    nothing is forced; the key itself is, without the quote (`":` or
    `" :` may follow)."""
    tok, grammar = _setup(vocab, backend, PERSON, whitespace="flexible")
    ids, seen = _walk(tok, grammar, '{"name": "John", "age": 42, "kind": "beta"}')
    drafted = [_pieces(tok, ff) for ff in seen.values()]
    assert ["age"] in drafted and ["kind"] in drafted, drafted


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_boundary_committed_text_merges(backend):
    """Tekken writes `","` for the quote closing "John" and the forced `,"`:
    after a committed `John`, `"` (a split no canonical output has) no
    continuation is canonical, so nothing is drafted."""
    tok, grammar = _setup("tekken", backend, PERSON)
    head = tok.encode('{"name":"John', add_special_tokens=False)
    quote = tok.encode('"', add_special_tokens=False)
    assert _pieces(tok, tok.encode('John","', add_special_tokens=False)) == \
        ["John", '","']
    assert grammar.accept_tokens("t", head + quote)
    outcome = Outcome()
    assert forced_tokens(grammar, head + quote, tok, 8, outcome=outcome) == []
    assert outcome.forced == b',"age":' and outcome.result == "boundary"


@pytest.mark.parametrize("vocab,backend", CASES)
def test_boundary_forced_text_merges_with_what_follows(vocab, backend):
    """Forced `name":"` before a free string: `":"` is a token, but the
    string's first characters may join the quote (`"John` style tokens),
    so only `name` is drafted; before an integer `":` is cut the same way
    (tokens such as `":1`), before an enum value `":"` is kept."""
    tok, grammar = _setup(vocab, backend, PERSON)
    first = vocab_for(grammar, tok).encode_after('{"')
    assert grammar.accept_tokens("t", first)
    outcome = Outcome()
    ff = forced_tokens(grammar, first, tok, 8, outcome=outcome)
    assert outcome.forced == b'name":"'
    assert _pieces(tok, ff) == ["name"]


def test_special_tokens_end_the_context():
    """A special token among the recent ones is not decoded into the text
    (the forced text is tokenized on its own from there)."""
    tok, grammar = _setup("tekken", "xgrammar", {"const": "abc def"})
    ff = forced_tokens(grammar, [tok.eos_token_id], tok, 8)
    assert ff == tok.encode('"abc def"', add_special_tokens=False)


def test_keep_walked_and_outlines():
    tok, grammar = _setup("tekken", "xgrammar", {"const": "abc def"})
    ff = forced_tokens(grammar, [], tok, 8, keep_walked=True)
    assert ff and forced_bytes(grammar) == b""  # advanced past the value
    grammar.rollback(len(ff))
    assert forced_bytes(grammar) == b'"abc def"'
    # A grammar object of another kind: no forced text to ask for.
    assert forced_tokens(object(), [], tok, 8) == []


def test_tokenizations_memoized():
    """The same context + forced text (rows of one schema, step after step)
    is tokenized once; the memo returns fresh lists equal to the
    tokenizer's own result."""
    tok, grammar = _setup("tekken", "xgrammar", PERSON)
    vocab = vocab_for(grammar, tok)
    vocab._encoded.clear()
    calls = []
    real = vocab.encode
    vocab.encode = lambda text: calls.append(text) or real(text)
    try:
        first = vocab.encode_after('{"name":"')
        second = vocab.encode_after('{"name":"')
    finally:
        vocab.encode = real
    assert first == second == list(tok.encode('{"name":"', add_special_tokens=False))
    assert first is not second and len(calls) == 1
    second.append(-1)
    assert vocab.encode_after('{"name":"') == first
