"""G3 for vllm.v1.structured_output: bitmask rows after a grammar's end.

Stock `StructuredOutputManager.grammar_bitmask` leaves two kinds of rows
all-ones (every token allowed): the row after a draft that terminated the
grammar (`_fill_bitmasks` writes `_full_mask` for a terminated grammar), and
every row after a request's first -1 draft (async scheduling pads
grammar-invalid and post-terminal drafts with -1). The V1 runner then
verifies post-terminal drafts, and samples the bonus, against them.

`g3-bitmask-rows` (wraps `_fill_bitmasks`, which the speculative walk calls
once per row, in row order, per request):
- the row of a grammar that terminated during this walk allows only the
  grammar's stop tokens. A grammar already terminated when its walk began
  keeps stock's row, so `VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION=0` behaves
  as stock;
- a row the walk leaves unconstrained right after a constrained row of the
  same request (stock does that only after the request's first -1 draft:
  the reasoning part of a request comes before its constrained part, never
  after) repeats the row before it, so every row after the first -1 draft,
  the bonus row included, is the row at it (the valid-prefix row, or the
  stop-only row), as stock already does after a failed accept.

The walk's state per request (its grammar, the last row, whether it was
constrained, whether the grammar had ended when the walk reached it) is
kept on the manager object that walks: the threaded walk (`parallel_rows`,
its own patch on `grammar_bitmask`) runs requests side by side, each chunk
of requests on one thread and its own shallow copy of the manager.
Working per row keeps this patch independent of the row layout (0.32 packs
1 + len(drafts) rows per request, 0.33 gives k + 1) and of who walks the
rows: on a vLLM build that fills these rows itself (the patch series) this
patch is not applied and the threaded walk still is.

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

logger = init_logger(__name__)

_TARGET_MODULE = "vllm.v1.structured_output"

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


# The row walk a manager is in, one tuple in the manager's own __dict__
# (read and written once per row): the request's grammar, its last row
# (bitmask tensor and index), whether that row was constrained, and whether
# the grammar had already ended when the walk reached it. One walker per
# manager object: the engine thread walks the manager, and each chunk of
# the threaded walk (`parallel_rows`) is walked by one thread on its own
# shallow copy of it, whose bitmask is another tensor (so a copied state
# never continues a walk).
_STATE_ATTR = "_vllm_patch_g3_rows_walk"
_NO_WALK: tuple[Any, Any, int, bool, bool] = (None, None, -1, False, False)
# Whether a manager's steps have drafts (its configuration's speculative
# tokens, not a diffusion model): read once per manager, not per row.
_SPEC_ATTR = "_vllm_patch_g3_rows_spec"


def _make_fill_bitmasks(original: Any) -> Any:
    def _fill_bitmasks(self: Any, batch: Any) -> None:
        d = self.__dict__
        spec = d.get(_SPEC_ATTR)
        if spec is None:
            vc = self.vllm_config
            spec = d[_SPEC_ATTR] = bool(
                vc.num_speculative_tokens and not vc.model_config.is_diffusion)
        if not spec:
            return original(self, batch)
        if type(batch) is not tuple and type(batch) is not list:
            batch = list(batch)
        if len(batch) != 1:
            # Not the speculative walk (it fills one row per call).
            d[_STATE_ATTR] = _NO_WALK
            return original(self, batch)
        entry = batch[0]
        grammar = entry[0]
        index = entry[1]
        bitmask = self._grammar_bitmask
        last_grammar, last_bitmask, last_index, constrained, ended_at_start = \
            d.get(_STATE_ATTR, _NO_WALK)
        same_walk = (last_grammar is grammar and last_bitmask is bitmask
                     and index == last_index + 1)
        if not same_walk:
            # The request's first row: nothing of this step accepted yet.
            ended_at_start = grammar.is_terminated()
        if entry[2]:
            # Stock's constrained row (inline: one call less per row), but
            # a grammar that ended during this walk gets its stop-token row.
            if not grammar.is_terminated():
                grammar.fill_bitmask(bitmask, index)
            elif same_walk and not ended_at_start:
                fill_stop_row(bitmask, index, grammar)
            else:  # ended before the walk: stock's row
                original(self, batch)
            d[_STATE_ATTR] = (grammar, bitmask, index, True, ended_at_start)
        elif same_walk and constrained:
            # Unconstrained after a constrained row of the same request:
            # after its first -1 draft. Repeat the row before; what the
            # next row repeats is constrained.
            bitmask[index].copy_(bitmask[index - 1])
            d[_STATE_ATTR] = (grammar, bitmask, index, True, ended_at_start)
        else:
            original(self, batch)
            d[_STATE_ATTR] = (grammar, bitmask, index, False, ended_at_start)

    return _fill_bitmasks


_PIN_WALK = pin(
    f"{_TARGET_MODULE}:StructuredOutputManager.grammar_bitmask",
    "with drafts, the walk calls _fill_bitmasks once per row with one "
    "(grammar, index, apply_bitmask) entry, a request's rows in order "
    "(draft rows, then the bonus row); apply_bitmask is False before "
    "constraint_start (reasoning) and for every row after the first -1 "
    "draft (seen_padding), which stock leaves all-ones; a failed accept's "
    "later rows are copied without a fill call; the grammar is rolled back "
    "after the request's rows")

PATCHES: list[Patch] = [
    Patch(
        name="g3-bitmask-rows",
        guarantee="G3",
        target=f"{_TARGET_MODULE}:StructuredOutputManager._fill_bitmasks",
        versions=("0.32", "0.33"),
        signature=("self", "batch"),
        make=_make_fill_bitmasks,
        why=("stock writes all-ones rows after a terminal draft (_full_mask "
             "for a terminated grammar) and after a request's first -1 "
             "(grammar-invalid / post-terminal) draft, so the V1 runner "
             "verifies post-terminal drafts and samples the bonus "
             "unconstrained (audit P3)"),
        how=("per row of the speculative walk: a constrained row of a grammar "
             "that terminated during this walk gets only the grammar's stop "
             "tokens (xgrammar matcher.stop_token_ids; guidance/outlines fill "
             "it themselves); a row left unconstrained after a constrained "
             "row of the same request (after its first -1 draft) repeats the "
             "row before it, as stock does after a failed accept. Per row, "
             "so independent of the row layout (0.32 packed, 0.33 k+1 per "
             "request) and of the threaded walk (parallel-verify-rows)."
             " Design: rows are fixed on the scheduler side because only the "
             "scheduler holds the grammar (the worker cannot build a "
             "stop-only row); acceptance is enforced on the worker "
             "(g3-v1-runner-acceptable-drafts) because a stop token drafted "
             "after the terminal would still pass a stop-only row."),
        upstream=UPSTREAM,
        remove_when=("vLLM fills stop-only rows after a terminal draft and "
                     "stops writing all-ones rows after -1 drafts"),
        pins=(
            _PIN_WALK,
            pin(f"{_TARGET_MODULE}:StructuredOutputManager._fill_bitmasks",
                "entries are (grammar, index, apply_bitmask) rows of "
                "self._grammar_bitmask (0.33: and the masked reasoning "
                "ends); a constrained row of a grammar not terminated is "
                "grammar.fill_bitmask(bitmask, index) alone (the patch does "
                "that itself for a one-row call); a terminated grammar's row "
                "and a row with apply_bitmask False are _full_mask (all "
                "tokens; 0.33: minus the masked ids), the rows the patch "
                "replaces"),
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
]
