"""The grammar's forced continuation as draft tokens, tokenized the way the
model tokenizes it.

A grammar often forces a stretch of text: after `{"` in a schema with one
possible first key, the key, its closing quote and the colon are the only
possible continuation. Such text is "forced" (MaskBench: 13-15 % of the
tokens of JSON outputs). Counting the draft positions where the grammar
allows exactly one token finds almost none of it with a real tokenizer:
a forced string has several tokenizations (`"`, `":`, `":"` are all tokens
of the 131k Tekken vocabulary), so several tokens are allowed. The forced
text itself comes from the grammar library:

- xgrammar: `GrammarMatcher.find_jump_forward_string()`;
- llguidance: `LLMatcher.compute_ff_bytes()`;
- outlines: its index is token-level (outlines_core's `Guide` has no
  byte-level automaton to query), so there is no forced string to ask for;
  a forced continuation could only be derived from the allowed-token masks,
  one full mask per forced token (the cost this module avoids): not done,
  outlines grammars get no forced drafts.

Turning the forced text into tokens is the delicate part (this module's
boundary rule). A draft that a model would not produce costs a wasted
draft slot (the target verifies every draft, so correctness never depends
on it), and a canonical tokenization is what models produce:

1. Start: the last two committed tokens are decoded to bytes and
   re-tokenized together with the forced text (after a newline with a
   tokenizer that puts a space in front of every text it encodes, as
   SentencePiece does: the newline's tokens are dropped again). The
   result must begin with exactly those committed tokens, else the
   committed text and the forced text merge into other tokens (Tekken:
   committed `John` + `"` and forced `,"age":` tokenizes as `","`, `age`,
   `":`; no continuation of `John`, `"` can be canonical) and nothing is
   drafted. The tokens after them are the candidates.
2. End: a candidate token near the end of the forced text may merge with
   the text the model writes next (forced `name":"` is `name`, `":"`, but
   `"J...` starting a value could take the quote into a longer token). The
   candidates are cut at the first byte offset p such that the forced
   text from p on is a proper prefix of some vocabulary token whose next
   byte the grammar allows after the forced text (checked on the grammar
   with the single-byte token of that byte, then rolled back); only
   tokens ending at or before p are kept. This is llguidance's healing
   rule (its `docs/fast_forward.md`), with a byte-level grammar check
   that over-approximates what the grammar allows (so it cuts at least
   as often as the exact check would).
3. Every kept token is validated by the grammar in sequence; the first
   refused one and all after it are dropped.

The grammar object passed in is left at the state it had (the caller's
shadow grammar), unless `keep_walked` asks for it to stay advanced by the
returned tokens.

Cost: the common case, nothing forced, is one library call (xgrammar
about 1-2 us, llguidance about 0.2 us, 131k vocabulary, this machine).
The first call with a tokenizer builds its byte table (about 0.5-1 s for
131k tokens, once per process). With forced text, about 14-18 us per call
(131k Tekken, a key of a small schema): the tokenizations are memoized per
vocabulary (rows of one schema force the same texts step after step),
which takes about a quarter off; the rest is the grammar's own
validate / accept / rollback calls.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

# Committed tokens re-tokenized with the forced text (rule 1).
CONTEXT_TOKENS = 2
# A text that ends every token before it, put in front of the text encoded
# by a tokenizer with a dummy prefix (SentencePiece: "\n" is a byte token).
LEAD = "\n"
# Memoized "bytes that may follow this suffix inside a longer token"
# entries per vocabulary (suffixes of forced strings: a schema's keys and
# punctuation, few in practice).
_NEXT_BYTES_CAP = 1 << 16
# Memoized tokenizations of context + forced text per vocabulary.
_ENCODED_CAP = 1 << 16
_ENCODED_TEXT_MAX = 512


def forced_bytes(grammar: Any) -> bytes:
    """The text the grammar forces from its current state (b"" if none or
    unknown for this backend)."""
    matcher = getattr(grammar, "matcher", None)
    if matcher is not None and hasattr(matcher, "find_jump_forward_string"):
        if grammar.is_terminated():
            return b""
        return matcher.find_jump_forward_string().encode("utf-8")
    ll = getattr(grammar, "ll_matcher", None)
    if ll is not None and hasattr(ll, "compute_ff_bytes"):
        if ll.is_stopped() or ll.is_error():
            return b""
        return bytes(ll.compute_ff_bytes())
    return b""


@dataclass
class Vocab:
    """What the boundary rule needs to know of a tokenizer."""

    token_bytes: list[bytes]
    special: frozenset[int]
    encode: Callable[[str], list[int]]
    # Sorted distinct byte strings of the ordinary (non-special) tokens.
    ordered: list[bytes] = field(default_factory=list)
    max_len: int = 0
    # byte value -> id of the ordinary token that is exactly that byte.
    byte_token: dict[int, int] = field(default_factory=dict)
    # The tokenizer puts a space before every text it encodes
    # (SentencePiece's dummy prefix): texts are encoded after LEAD, whose
    # tokens `lead` are dropped again.
    dummy_prefix: bool = False
    lead: list[int] = field(default_factory=list)
    _next: dict[bytes, tuple[int, ...]] = field(default_factory=dict)
    # Memoized encode_after: a batch's requests mostly share a few schemas,
    # so the same context + forced text comes back row after row and step
    # after step (the tokenizer's encode is most of a forced call's cost).
    _encoded: dict[str, tuple[int, ...] | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ordinary = {b for i, b in enumerate(self.token_bytes)
                    if b and i not in self.special}
        self.ordered = sorted(ordinary)
        self.max_len = max((len(b) for b in self.ordered), default=0)
        for i, b in enumerate(self.token_bytes):
            if len(b) == 1 and i not in self.special:
                self.byte_token.setdefault(b[0], i)
        probe = self.encode("a")
        self.dummy_prefix = bool(probe) and \
            b"".join(self.token_bytes[t] for t in probe) == b" a"
        if self.dummy_prefix:
            self.lead = self.encode(LEAD)
            after = self.encode(LEAD + "a")
            if after[:len(self.lead)] != self.lead or \
                    b"".join(self.token_bytes[t]
                             for t in after[len(self.lead):]) != b"a":
                raise ValueError("cannot encode a text in the middle of an "
                                 "output with this tokenizer")

    def encode_after(self, text: str) -> list[int] | None:
        """`text` tokenized as a continuation (no dummy prefix); None when
        the lead does not come out as expected."""
        try:
            got = self._encoded[text]
        except KeyError:
            got = self._encode_after(text)
        return None if got is None else list(got)

    def _encode_after(self, text: str) -> tuple[int, ...] | None:
        if not self.dummy_prefix:
            got: tuple[int, ...] | None = tuple(self.encode(text))
        else:
            ids = self.encode(LEAD + text)
            n = len(self.lead)
            got = tuple(ids[n:]) if ids[:n] == self.lead else None
        if len(text) <= _ENCODED_TEXT_MAX:
            if len(self._encoded) >= _ENCODED_CAP:
                self._encoded.clear()
            self._encoded[text] = got
        return got

    def next_bytes(self, suffix: bytes) -> tuple[int, ...]:
        """Distinct bytes that follow `suffix` inside the ordinary tokens
        that start with it and are longer (empty: no token extends it)."""
        got = self._next.get(suffix)
        if got is None:
            i = bisect.bisect_left(self.ordered, suffix)
            n = len(suffix)
            seen: dict[int, None] = {}
            while i < len(self.ordered) and self.ordered[i].startswith(suffix):
                b = self.ordered[i]
                if len(b) > n:
                    seen.setdefault(b[n])
                i += 1
            got = tuple(seen)
            if len(self._next) >= _NEXT_BYTES_CAP:
                self._next.clear()
            self._next[suffix] = got
        return got


_VOCABS: dict[tuple[str, int], tuple[Any, Vocab]] = {}


def vocab_for(grammar: Any, tokenizer: Any) -> Vocab:
    """The Vocab of the model tokenizer with the grammar's token table,
    built once per process, tokenizer and backend kind."""
    table = getattr(grammar, "ll_tokenizer", None)
    kind = "guidance" if table is not None else "xgrammar"
    key = (kind, id(tokenizer))
    hit = _VOCABS.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    if table is None:
        # A new wrapper object at every access: not a cache key.
        table = getattr(getattr(grammar, "ctx", None), "tokenizer_info", None)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    if hasattr(table, "decode_bytes"):  # llguidance LLTokenizer
        n = int(table.vocab_size)
        token_bytes = [bytes(table.decode_bytes([i])) for i in range(n)]
        special.update(i for i in range(n) if table.is_special_token(i))
    elif _is_tekken(tokenizer):
        # xgrammar's table for Tekken (vLLM passes the str vocabulary)
        # replaces the bytes of partial UTF-8 tokens; the tokenizer's own
        # byte pieces are exact.
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

        tek = tokenizer.tokenizer
        token_bytes = [tek.id_to_byte_piece(i, SpecialTokenPolicy.KEEP)
                       for i in range(tek.n_words)]
    elif table is not None:  # xgrammar TokenizerInfo
        token_bytes = [bytes(b) for b in table.decoded_vocab]
        special.update(int(i) for i in table.special_token_ids)
    else:
        raise TypeError(f"no token table for {type(grammar).__name__}")

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    vocab = Vocab(token_bytes, frozenset(special), encode)
    _VOCABS[key] = (tokenizer, vocab)
    return vocab


def _is_tekken(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "is_tekken", False)) and \
        hasattr(getattr(tokenizer, "tokenizer", None), "id_to_byte_piece")


def _context(recent: Sequence[int], vocab: Vocab) -> list[int]:
    """The committed tokens re-tokenized with the forced text (rule 1):
    the last CONTEXT_TOKENS, none before a special token."""
    n = len(vocab.token_bytes)
    ctx: list[int] = []
    for t in reversed(recent[-CONTEXT_TOKENS:]):
        t = int(t)
        if t < 0 or t >= n or t in vocab.special:
            break
        ctx.append(t)
    ctx.reverse()
    return ctx


def _valid_utf8_prefix(data: bytes) -> bytes:
    try:
        data.decode("utf-8")
        return data
    except UnicodeDecodeError as exc:
        return data[:exc.start]


@dataclass
class Outcome:
    """Why a call returned what it did (for counters and the benchmark)."""

    forced: bytes = b""
    # "none" (nothing forced), "no_context" (the context ends inside a
    # character, or the tokenizer's lead came out merged), "boundary" (the committed and
    # the forced text merge), "roundtrip" (the tokens do not spell the
    # forced text), "cut" (everything cut at the end), "ok".
    result: str = "none"


def forced_tokens(grammar: Any, recent: Sequence[int], tokenizer: Any,
                  k: int, *, keep_walked: bool = False,
                  request_id: str = "forced-drafts",
                  outcome: Outcome | None = None) -> list[int]:
    """Up to `k` token ids of the grammar's forced continuation from its
    current state, tokenized as the model's tokenizer does (module
    docstring: the boundary rule), each accepted by the grammar in turn.

    grammar: a vLLM StructuredOutputGrammar (xgrammar or guidance; any
        other gets []) at the committed state: a shadow the caller owns.
        It is left at that state, or, with keep_walked, advanced by
        exactly the returned tokens (the caller rolls them back).
    recent: the last committed token ids, oldest first (only the last
        CONTEXT_TOKENS are read).
    tokenizer: the tokenizer the grammar's backend was built with (vLLM's
        TokenizerLike: `backend.tokenizer`, `StructuredOutputManager
        .tokenizer`).
    """
    if k <= 0:
        return []
    forced = forced_bytes(grammar)
    if outcome is not None:
        outcome.forced = forced
    if not forced:
        return []
    forced = _valid_utf8_prefix(forced)
    vocab = vocab_for(grammar, tokenizer)
    ctx = _context(recent, vocab)
    if not forced:
        return _done(outcome, "no_context", [])
    tb = vocab.token_bytes
    try:
        text = (b"".join(tb[t] for t in ctx) + forced).decode("utf-8")
    except UnicodeDecodeError:
        return _done(outcome, "no_context", [])  # a partial character
    ids = vocab.encode_after(text)
    if ids is None:
        return _done(outcome, "no_context", [])
    if ids[:len(ctx)] != ctx:
        return _done(outcome, "boundary", [])
    new = ids[len(ctx):]
    ends: list[int] = []
    pos = 0
    for t in new:
        pos += len(tb[t]) if 0 <= t < len(tb) else 1 << 30
        ends.append(pos)
    if pos != len(forced) or b"".join(tb[t] for t in new) != forced:
        return _done(outcome, "roundtrip", [])

    # Rule 3 first: the grammar must take the candidates (it walks them;
    # rule 2 checks bytes at the state after them).
    matcher = _xgrammar_matcher(grammar)
    if matcher is not None:
        # One pass: the grammar takes the candidates it accepts (as vLLM's
        # validate_tokens would count them) and stands after them.
        n = _accept_prefix(grammar, matcher, new)
    else:
        n = len(grammar.validate_tokens(new)) if new else 0
    new, ends = new[:n], ends[:n]
    end = ends[-1] if ends else 0
    lo = max(0, end - vocab.max_len)
    if len(new) > k and ends[k - 1] <= lo:
        # The first k tokens end before any token could reach past the end
        # of the forced text: no cut needed.
        keep = new[:k]
        if matcher is not None:
            undo = n - (k if keep_walked else 0)
            if undo:
                grammar.rollback(undo)
        elif keep_walked:
            grammar.accept_tokens(request_id, keep)
        return _done(outcome, "ok", keep)
    if matcher is None and new \
            and not grammar.accept_tokens(request_id, new):
        return _done(outcome, "cut", [])
    if not new:
        return _done(outcome, "cut", [])
    cut = end
    data = forced[:end]
    # Whether the grammar allows a byte next (one state: after the forced
    # text): asked once per byte however many offsets share it.
    allowed: dict[int, bool] = {}
    for p in range(lo, end):
        follow = vocab.next_bytes(data[p:])
        if follow and _any_byte_allowed(grammar, vocab, follow, allowed):
            cut = p
            break
    keep = [t for t, e in zip(new, ends) if e <= cut][:k]
    undo = len(new) - (len(keep) if keep_walked else 0)
    if undo:
        grammar.rollback(undo)
    return _done(outcome, "ok" if keep else "cut", keep)


def _xgrammar_matcher(grammar: Any) -> Any:
    """The xgrammar matcher under vLLM's grammar object, else None."""
    try:
        from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar
    except Exception:  # noqa: BLE001 - no xgrammar backend here
        return None
    return grammar.matcher if isinstance(grammar, XgrammarGrammar) else None


def _accept_prefix(grammar: Any, matcher: Any, tokens: Sequence[int]) -> int:
    """Advance an xgrammar grammar by the longest prefix of `tokens` it
    accepts, as vLLM's `validate_tokens` counts it (nothing once ended,
    and up to a token that ends it); vLLM's object kept in step (its
    `rollback` undoes them). Returns how many it took."""
    if grammar.is_terminated():
        return 0
    n = 0
    for token in tokens:
        if not matcher.accept_token(token):
            break
        n += 1
        if matcher.is_terminated():
            break
    grammar.num_processed_tokens += n
    grammar._is_terminated = matcher.is_terminated()
    return n


def _any_byte_allowed(grammar: Any, vocab: Vocab, follow: tuple[int, ...],
                      known: dict[int, bool] | None = None) -> bool:
    """Does the grammar (at its current state) allow one of these bytes
    next? Checked with each byte's single-byte token; a byte without one
    counts as allowed (the rule then cuts: the safe side). `known`: the
    answers so far at this same state (read and filled)."""
    for byte in follow:
        if known is not None:
            ok = known.get(byte)
            if ok is None:
                t = vocab.byte_token.get(byte)
                ok = known[byte] = t is None or bool(
                    grammar.validate_tokens([t]))
        else:
            t = vocab.byte_token.get(byte)
            ok = t is None or bool(grammar.validate_tokens([t]))
        if ok:
            return True
    return False


def _done(outcome: Outcome | None, result: str, tokens: list[int]) -> list[int]:
    if outcome is not None:
        outcome.result = result
    return tokens
