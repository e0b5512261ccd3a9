"""G3, worker side: which structured requests end in this step, read from
what the V1 runner already holds (no scheduler state, no grammar).

Fact this relies on (checked on xgrammar, guidance and outlines by
tests/v1/spec_decode/test_g3_draft_skip.py on vLLM 0.32 and 0.33): a grammar
terminates only when it accepts one of its stop tokens (xgrammar: the
request's `all_stop_token_ids`, i.e. EOS, generation-config EOS and user
stop ids; guidance / outlines: the tokenizer EOS, a subset of those). A
token sampled from a row the grammar filled (not an unconstrained all-ones
row: reasoning, an already terminated grammar) is a token the grammar
accepts there, so a stop token sampled from such a row terminates the
grammar, and patched G2 finishes the request at that token in the same
pass, with `ignore_eos` too. Without `ignore_eos`, or for a user stop id,
vLLM's own `check_stop` finishes it as well. Everything here errs towards
"not ending": a request that is not recognised keeps stock drafting.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

_ALL_ONES = np.uint32(0xFFFFFFFF)


def request_rows(
    structured_output_request_ids: Sequence[str],
    grammar_bitmask: np.ndarray,
    scheduled_spec_decode_tokens: dict[str, Sequence[int]],
    num_spec_tokens: int,
) -> dict[str, np.ndarray]:
    """Per structured request, its bitmask rows for this step (drafts +
    bonus), as uint32 words. vLLM 0.33 gives each request `k + 1` rows;
    0.32 packs `1 + len(drafts)` rows cumulatively (the two agree when every
    request has k drafts, so the shape tells which layout it is)."""
    ids = list(structured_output_request_ids)
    words = np.ascontiguousarray(grammar_bitmask).view(np.uint32)
    strided = words.shape[0] == len(ids) * (num_spec_tokens + 1)
    rows: dict[str, np.ndarray] = {}
    offset = 0
    for i, req_id in enumerate(ids):
        n = 1 + len(scheduled_spec_decode_tokens.get(req_id, ()))
        start = i * (num_spec_tokens + 1) if strided else offset
        rows[req_id] = words[start:start + n]
        offset += n
    return rows


def _admits(row: np.ndarray, token: int) -> bool:
    word = token >> 5
    return 0 <= word < row.size and bool((int(row[word]) >> (token & 31)) & 1)


def _stop_only(row: np.ndarray, stops: Iterable[int]) -> bool:
    rest = row.copy()
    for t in stops:
        if 0 <= (t >> 5) < rest.size:
            rest[t >> 5] &= ~np.uint32(1 << (t & 31))
    return not rest.any()


def grammar_row(row: np.ndarray, stops: Iterable[int], stop_only: bool) -> bool:
    """Whether `row` was filled by the grammar (it constrains the token).
    All-ones rows are unconstrained. With `stop_only` (a reasoning parser is
    configured: vLLM 0.33 writes reasoning rows as all-ones minus a few
    reasoning-end ids, indistinguishable from a permissive grammar row) only
    a row that admits nothing but stop tokens counts."""
    if bool((row == _ALL_ONES).all()):
        return False
    return _stop_only(row, stops) if stop_only else True


def may_end(rows: np.ndarray, stops: frozenset[int], stop_only: bool) -> bool:
    """Cheap pre-check without the sampled tokens: can the request end in
    this step at all (some grammar row of it admits a stop token)?"""
    return bool(stops) and any(
        grammar_row(r, stops, stop_only) and any(_admits(r, t) for t in stops)
        for r in rows)


def ends_at(rows: np.ndarray, sampled: Sequence[int], stops: frozenset[int],
            stop_only: bool) -> int | None:
    """Index of the sampled token at which the request's grammar ends (a stop
    token sampled from a grammar row), or None. `sampled`: this step's
    tokens for the request (accepted drafts + bonus; -1 = rejected, ends)."""
    for j, t in enumerate(sampled):
        t = int(t)
        if t < 0 or j >= len(rows):
            return None
        if t in stops and grammar_row(rows[j], stops, stop_only) \
                and _admits(rows[j], t):
            return j
    return None


def stop_set(sampling_params: Any) -> frozenset[int]:
    """The stop tokens a request's grammar can end on, or an empty set when
    the worker cannot tell (no stop ids: xgrammar then uses the tokenizer's
    own stop tokens; min_tokens: stop tokens are masked for a while)."""
    if sampling_params is None or getattr(sampling_params, "min_tokens", 0):
        return frozenset()
    stops = set(getattr(sampling_params, "all_stop_token_ids", None) or ())
    eos = getattr(sampling_params, "eos_token_id", None)
    if eos is not None:
        stops.add(eos)
    return frozenset(int(t) for t in stops)


def withhold_drafts(out: Any, drop: Any) -> Any:
    """The runner's hand-over (`take_draft_token_ids`) with no drafts for the
    requests in `drop` (their grammar ended; shared by the V1 and V2 runner
    patches)."""
    if out is not None and drop:
        out.draft_token_ids = [
            [] if req_id in drop else list(ids)
            for req_id, ids in zip(out.req_ids, out.draft_token_ids)]
    return out
