"""G3 for vllm.v1.structured_output: bitmask rows after a grammar's end.

Stock `StructuredOutputManager.grammar_bitmask` leaves two kinds of rows
all-ones (every token allowed): the row after a draft that terminated the
grammar (`_fill_bitmasks` writes `_full_mask` for a terminated grammar), and
every row after a request's first -1 draft (async scheduling pads
grammar-invalid and post-terminal drafts with -1). The V1 runner then
verifies post-terminal drafts, and samples the bonus, against them.

- `g3-terminal-row` (wraps `_fill_bitmasks`): the row of a grammar that
  terminated during this walk allows only the grammar's stop tokens. A
  grammar already terminated when the walk began keeps stock's row, so
  `VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION=0` behaves as stock.
- `g3-rows-after-padding-0.32` / `-0.33` (wraps `grammar_bitmask`): every
  row after a request's first -1 draft, the bonus row included, repeats the
  row at it (the valid-prefix row, or the stop-only row), as stock already
  does after a failed accept; only the row layout differs by series. The
  same wrapper walks a large xgrammar batch's requests in chunks on vLLM's
  fill threads where that is faster (`parallel_rows`; stock's walk per
  chunk, the same rows).

Which drafts the worker may accept is enforced by
`vllm_patch.v1.worker.gpu_model_runner.g3_drafts`. Requests without structured output
and steps without drafts take the stock path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.logger import init_logger

from vllm_patch.audited import pin
from vllm_patch.patching import Patch
from vllm_patch.v1.structured_output import parallel_rows

logger = init_logger(__name__)

_TARGET_MODULE = "vllm.v1.structured_output"
# Set on the manager for the duration of one patched grammar_bitmask walk:
# ids of the grammars that were already terminated when the walk began.
_AT_START_ATTR = "_vllm_patch_g3_terminated_at_start"

UPSTREAM = ("SGLang PR #24082 / #28682 (worker side); vLLM Model Runner V2 "
            "`grammar_invalid_drafts` (v1/worker/gpu/structured_outputs.py)")


def _set_only(row: Any, token_ids: Any) -> None:
    """Make bitmask `row` (torch int32, one row) allow exactly `token_ids`."""
    row.zero_()
    bits = row.numpy().view(np.uint32)
    for t in token_ids:
        t = int(t)
        if 0 <= t < bits.size * 32:
            bits[t >> 5] |= np.uint32(1 << (t & 31))


def fill_stop_row(bitmask: Any, index: int, grammar: Any) -> None:
    """Write into `bitmask[index]` the row of a terminated `grammar`: only its
    stop tokens (what the grammar admits at its end), never all tokens."""
    matcher = getattr(grammar, "matcher", None)
    stops = getattr(matcher, "stop_token_ids", None) if matcher is not None else None
    if stops:  # xgrammar: the matcher raises if asked to fill once terminated
        _set_only(bitmask[index], stops)
        return
    try:  # guidance, outlines: an EOS-only row once stopped
        grammar.fill_bitmask(bitmask, index)
        if bool(bitmask[index].any()):
            return
    except Exception:  # noqa: BLE001 - fall back below
        pass
    # Unknown backend: the row the terminal token itself was drawn from (the
    # previous row of this request: termination happened in this walk).
    logger.warning_once(
        "vllm_patch: G3: grammar backend %s gives no stop-token row after its "
        "end; the row after a terminal draft repeats the terminal's own row",
        type(grammar).__name__)
    if index > 0:
        bitmask[index].copy_(bitmask[index - 1])
    else:  # cannot happen for an in-walk termination; never leave it empty
        bitmask[index].fill_(-1)


def _make_fill_bitmasks(original: Any) -> Any:
    def _fill_bitmasks(self: Any, batch: Any) -> None:
        batch = list(batch)
        original(self, batch)
        at_start = getattr(self, _AT_START_ATTR, None)
        if at_start is None:
            return  # not inside a patched speculative walk
        for entry in batch:
            grammar, index, apply_bitmask = entry[0], entry[1], entry[2]
            if (apply_bitmask and id(grammar) not in at_start
                    and grammar.is_terminated()):
                fill_stop_row(self._grammar_bitmask, index, grammar)

    return _fill_bitmasks


def first_padding(tokens: Any) -> int | None:
    for i, t in enumerate(tokens):
        if t < 0:
            return i
    return None


def copy_rows_after_padding(
    bitmask: np.ndarray,
    structured_output_request_ids: list[str],
    scheduled_spec_decode_tokens: dict[str, list[int]],
    mask_stride: int | None,
) -> None:
    """Rows after a request's first -1 draft := the row at that draft.
    `mask_stride` None: 0.32 cumulative layout; else 0.33 fixed stride."""
    offset = 0
    for i, req_id in enumerate(structured_output_request_ids):
        tokens = scheduled_spec_decode_tokens.get(req_id, ())
        start = offset if mask_stride is None else i * mask_stride
        offset += 1 + len(tokens)
        p = first_padding(tokens)
        if p is None:
            continue
        end = start + len(tokens) + 1  # bonus row included
        if end > start + p + 1 and end <= bitmask.shape[0]:
            bitmask[start + p + 1:end] = bitmask[start + p]


def _make_grammar_bitmask(series: str) -> Any:
    def make(original: Any) -> Any:
        def grammar_bitmask(self: Any, requests: Any,
                            structured_output_request_ids: list[str],
                            scheduled_spec_decode_tokens: dict[str, list[int]]):
            k = self.vllm_config.num_speculative_tokens
            if (not structured_output_request_ids or not k
                    or self.vllm_config.model_config.is_diffusion):
                return original(self, requests, structured_output_request_ids,
                                scheduled_spec_decode_tokens)
            at_start = set()
            for req_id in structured_output_request_ids:
                so_req = requests[req_id].structured_output_request
                grammar = so_req.grammar if so_req is not None else None
                if grammar is not None and grammar.is_terminated():
                    at_start.add(id(grammar))
            setattr(self, _AT_START_ATTR, at_start)
            try:
                # Requests' walks side by side where that pays (stock's
                # walk per chunk; the same rows as one serial walk).
                bitmask = parallel_rows.walk(
                    self, original, requests, structured_output_request_ids,
                    scheduled_spec_decode_tokens,
                    None if series == "0.32" else k + 1)
            finally:
                setattr(self, _AT_START_ATTR, None)
            if bitmask is not None:
                copy_rows_after_padding(
                    bitmask, structured_output_request_ids,
                    scheduled_spec_decode_tokens,
                    None if series == "0.32" else k + 1,
                )
            return bitmask

        return grammar_bitmask

    return make


_PIN_BITMASK = pin(
    f"{_TARGET_MODULE}:StructuredOutputManager.grammar_bitmask",
    "row layout (0.32: 1 + len(drafts) rows per request, packed; 0.33: "
    "k + 1 rows per request); the speculative walk advances the grammar "
    "draft by draft, hands (grammar, index, apply_bitmask, ...) entries to "
    "_fill_bitmasks, leaves every row after the first -1 draft all-ones "
    "(seen_padding), copies the row of a failed accept to the rows after it "
    "(failed_index), and rolls the grammar back afterwards")

_WHY_ROWS = (
    "stock writes all-ones rows after a terminal draft and after the first -1 "
    "(grammar-invalid / post-terminal) draft, so the V1 runner verifies "
    "post-terminal drafts and samples the bonus unconstrained (audit P3)"
)
_HOW_ROWS = (
    "after the stock walk, rows after a request's first -1 draft copy the row "
    "at it (valid-prefix row or stop-only row), as stock already does after a "
    "failed accept; layout per series; a large xgrammar batch is walked in "
    "request chunks on vLLM's fill threads where measured faster (same rows)"
)
_DESIGN = (
    " Design: rows are fixed on the scheduler side because only the scheduler "
    "holds the grammar (the worker cannot build a stop-only row); acceptance "
    "is enforced on the worker (g3-v1-runner-acceptable-drafts) because a "
    "stop token drafted after the terminal would still pass a stop-only row."
)

PATCHES: list[Patch] = [
    Patch(
        name="g3-terminal-row",
        guarantee="G3",
        target=f"{_TARGET_MODULE}:StructuredOutputManager._fill_bitmasks",
        versions=("0.32", "0.33"),
        signature=("self", "batch"),
        make=_make_fill_bitmasks,
        why=("a grammar terminated by one of this step's drafts gets an "
             "all-ones row (_full_mask) for the next position and the bonus"),
        how=("after the stock fill, a constrained row of a grammar that "
             "terminated during this walk gets only the grammar's stop tokens "
             "(xgrammar matcher.stop_token_ids; guidance/outlines fill it "
             "themselves)" + _DESIGN),
        upstream=UPSTREAM,
        remove_when="vLLM fills stop-only rows after a terminal draft",
        pins=(
            _PIN_BITMASK,
            pin(f"{_TARGET_MODULE}:StructuredOutputManager._fill_bitmasks",
                "entries are (grammar, index, apply_bitmask, ...) rows of "
                "self._grammar_bitmask; a terminated grammar's row is "
                "_full_mask (all tokens), the row the patch replaces"),
            pin("vllm.v1.structured_output.backend_guidance:GuidanceGrammar"
                ".fill_bitmask",
                "a stopped llguidance matcher fills an EOS-only row "
                "(fill_stop_row keeps it)"),
            pin("vllm.v1.structured_output.backend_outlines:OutlinesGrammar"
                ".fill_bitmask",
                "writes the outlines guide's mask, EOS-only in a final state "
                "(fill_stop_row keeps it)"),
        ),
    ),
    Patch(
        name="g3-rows-after-padding-0.33",
        guarantee="G3",
        target=f"{_TARGET_MODULE}:StructuredOutputManager.grammar_bitmask",
        versions=("0.33",),
        signature=("self", "requests", "structured_output_request_ids",
                   "scheduled_spec_decode_tokens"),
        make=_make_grammar_bitmask("0.33"),
        why=_WHY_ROWS,
        how=_HOW_ROWS + " (0.33: mask_stride = k+1 rows per request)" + _DESIGN,
        upstream=UPSTREAM,
        remove_when="vLLM stops writing all-ones rows after -1 drafts",
        pins=(_PIN_BITMASK,),
    ),
    Patch(
        name="g3-rows-after-padding-0.32",
        guarantee="G3",
        target=f"{_TARGET_MODULE}:StructuredOutputManager.grammar_bitmask",
        versions=("0.32",),
        signature=("self", "requests", "structured_output_request_ids",
                   "scheduled_spec_decode_tokens"),
        make=_make_grammar_bitmask("0.32"),
        why=_WHY_ROWS,
        how=_HOW_ROWS + " (0.32: rows packed cumulatively, 1+len(drafts) each)"
            + _DESIGN,
        upstream=UPSTREAM,
        remove_when="0.32 support is dropped",
        pins=(_PIN_BITMASK,),
    ),
]
