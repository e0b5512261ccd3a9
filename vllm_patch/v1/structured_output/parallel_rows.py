"""Speculative verification rows filled on several threads.

With speculative decoding, stock `StructuredOutputManager.grammar_bitmask`
fills every structured request's rows one by one on the engine thread: for
each draft, fill the row, accept the draft, and one more row for the bonus
token, then roll the grammar back. That is B x (k + 1) fills per step (1,280
at B=256, k=4), about 57 ms with a 131k vocabulary and xgrammar, while the
GPU's forward pass, which the fill overlaps, takes 10-30 ms. vLLM already
fills on a thread pool (`executor_for_fillmask`: half the cores, at most 8)
but only without drafts, because the walk accepts and rolls back between
fills.

Each request's walk is independent of the others' (its own grammar, its own
rows), so:

- xgrammar: the batch splits into contiguous chunks of about CHUNK_ROWS
  rows, which the engine thread and vLLM's fill threads take one after
  another, and each chunk is walked by the stock method itself, on a
  shallow copy of the manager whose bitmask is the chunk's slice of the
  batch's bitmask. The rows, the grammar calls and their order within a
  request are stock's; only requests run side by side.
- llguidance (guidance backend): its single-row fill gains nothing on
  Python threads, but the library walks a whole batch itself
  (`fill_next_token_bitmask_par_with_draft_tokens`: for each request the
  row before each draft and the bonus row, accepting the drafts and rolling
  them back, on its own thread pool, the GIL released). The batch is handed
  to it on a pool of as many threads as the threaded xgrammar walk has
  lanes. It takes only the requests whose rows it fills as stock does:
  grammar-valid drafts with no stop token and no -1 padding, a grammar not
  ended, no reasoning before the constraint. Every other request, and any
  request whose drafts its rows do not allow (checked on the filled rows),
  is walked by the stock method on its own rows.

Threads pay only where a row's fill outweighs the Python around it, which
holds the GIL: measured on two lanes at a 131k vocabulary, 1.1-1.7x from
B=128 with xgrammar, up to 1.4x with llguidance where rows are dear (k=7,
B >= 128; nothing at k=1); nothing at 32k (xgrammar), a loss below about
128 rows. So the
walk is threaded only with xgrammar or llguidance, a vocabulary of at least
MIN_VOCAB tokens, vLLM's fill pool present (it exists when `max_num_seqs`
> 128), at least MIN_ROWS rows, and where the manager's own measurements
(`Choice`: wall time per row, serial against threaded) say threads are
cheaper. `VLLM_PATCH_PARALLEL_VERIFY=0` keeps the serial walk.
"""

from __future__ import annotations

import copy
import itertools
import statistics
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from vllm_patch import envs
from vllm_patch.audited import pin
from vllm_patch.patching import Patch

# A step with fewer rows stays serial: handing work to a thread costs more
# than it saves (benchmarks/verify_rows_parallel.py).
MIN_ROWS = 128
# Rows per unit of work a lane takes at a time.
CHUNK_ROWS = 24
# Smaller vocabularies stay serial. A row's fill grows with the vocabulary
# (one bit per token); below this it is too short for threads to pay for
# what they cost the step, and the walk's own timing does not see that
# cost: at 32k tokens (B=256, k=4, two lanes) the scheduler measured its
# threaded walk at 0.81-0.89 of serial per row while the step's
# verification took 1.08-1.15x stock's wall time per row
# (benchmarks/grammar_draft_cost.py, three runs); at 131k threads paid
# 1.5-1.7x in every cell from 128 rows (benchmarks/verify_rows_parallel.py).
MIN_VOCAB = 65536
# Walks per mode the choice remembers; one probe of the other mode every
# PROBE_EVERY eligible steps.
WINDOW = 5
PROBE_EVERY = 100
_CHOICE_ATTR = "_vllm_patch_parallel_rows_choice"
# Backends whose rows fill on several threads: xgrammar's row fill releases
# the GIL; llguidance walks a batch's drafts on its own threads.
PARALLEL_BACKENDS = frozenset({"XgrammarBackend", "GuidanceBackend"})
_LL_EXECUTOR_ATTR = "_vllm_patch_parallel_rows_ll_executor"


class _Stats:
    """Process-wide counters (tests and the benchmark read them)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.parallel_steps = 0
        self.serial_steps = 0
        self.chunks = 0

    def count(self, chunks: int) -> None:
        with self.lock:
            if chunks > 1:
                self.parallel_steps += 1
                self.chunks += chunks
            else:
                self.serial_steps += 1


STATS = _Stats()


def lanes(manager: Any) -> int:
    """Threads available to one walk: vLLM's fill pool and the engine
    thread itself (it would otherwise wait)."""
    pool = getattr(manager, "executor_for_fillmask", None)
    workers = getattr(pool, "_max_workers", 0) if pool is not None else 0
    return 1 + int(workers or 0)


def row_counts(ids: list[str], spec: dict[str, list[int]], stride: int | None
               ) -> list[int]:
    """Rows per request: 0.32 packs 1 + len(drafts); 0.33 gives k + 1."""
    if stride is not None:
        return [stride] * len(ids)
    return [1 + len(spec.get(rid, ())) for rid in ids]


def plan(counts: list[int]) -> list[tuple[int, int]]:
    """Contiguous (start, end) request ranges of about CHUNK_ROWS rows each
    (one range: the walk stays serial). Lanes take the next range as they
    finish one, so a few slow rows (a long fill deep in a document) do not
    leave the other lanes idle."""
    total = sum(counts)
    if total < MIN_ROWS or len(counts) < 2:
        return [(0, len(counts))]
    out, start, acc = [], 0, 0
    for i, c in enumerate(counts):
        acc += c
        if acc >= CHUNK_ROWS:
            out.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(counts):
        out.append((start, len(counts)))
    return out


class Choice:
    """Per manager: whether threads pay for this batch, from measurement.
    The wall time per row of the last few serial and threaded walks; the
    cheaper mode runs, and every PROBE_EVERY-th eligible step runs the
    other once, so a change in the batch (longer documents, another
    vocabulary's cost per row) is seen. Serial first: a walk is threaded
    only after two threaded walks measured cheaper per row than serial.
    Each mode's first walk is not kept: the first walk over new grammar
    states is slow in either mode (found: a cold serial walk made threads
    look cheaper at a 32k vocabulary, where they are 20 % dearer)."""

    def __init__(self) -> None:
        self.per_row: dict[bool, deque[float]] = {
            False: deque(maxlen=WINDOW), True: deque(maxlen=WINDOW)}
        self.steps = 0
        self.seen = {False: False, True: False}
        # Every walk's wall time per row on the engine thread, whichever
        # way it ran (`row_ns`); the first walk is not kept (cold).
        self.walks: deque[float] = deque(maxlen=WINDOW)
        self.walked = False

    def threaded(self) -> bool:
        self.steps += 1
        serial, threaded = self.per_row[False], self.per_row[True]
        if len(serial) < 2:
            return False
        if len(threaded) < 2:
            return True
        best = statistics.median(threaded) < statistics.median(serial)
        return (not best) if self.steps % PROBE_EVERY == 0 else best

    def ratio(self) -> float:
        """The wall time per row of a threaded walk as a share of a serial
        one, from the measured walks (no side effect on the choice): 1.0
        until both modes are measured, or where threads are not cheaper
        (then the walk runs serially)."""
        serial, threaded = list(self.per_row[False]), list(self.per_row[True])
        if len(serial) < 2 or len(threaded) < 2:
            return 1.0
        s, t = statistics.median(serial), statistics.median(threaded)
        return min(1.0, t / s) if s > 0 else 1.0

    def record_walk(self, ns: int, rows: int) -> None:
        if not self.walked:
            self.walked = True
            return
        if rows > 0:
            self.walks.append(ns / rows)

    def record(self, threaded: bool, ns: int, rows: int) -> None:
        if not self.seen[threaded]:
            self.seen[threaded] = True
            return
        self.per_row[threaded].append(ns / max(rows, 1))


def choice(manager: Any) -> Choice:
    c = getattr(manager, _CHOICE_ATTR, None)
    if c is None:
        c = Choice()
        setattr(manager, _CHOICE_ATTR, c)
    return c


def _may_thread(manager: Any) -> bool:
    """The gates of a threaded walk that do not depend on the step: vLLM's
    fill pool present, a backend whose rows fill on several threads, a
    vocabulary large enough for its fills to pay on threads, the switch."""
    if lanes(manager) < 2:
        return False
    backend = getattr(manager, "backend", None)
    if type(backend).__name__ not in PARALLEL_BACKENDS:
        return False
    if (getattr(backend, "vocab_size", 0) or 0) < MIN_VOCAB:
        return False
    return envs.settings().parallel_verify


def wanted(manager: Any, ids: list[str]) -> bool:
    """Whether this walk may run on threads at all."""
    return len(ids) >= 2 and _may_thread(manager)


def row_factor(manager: Any, rows: int) -> float:
    """What a verification row costs this manager's engine thread, as a
    share of a row of the serial walk: where a walk of `rows` rows would
    be threaded (the gates of `wanted` and `plan`, and the manager's own
    measurements in `Choice`: threads measured cheaper), the measured ratio
    of the wall time per row threaded to serial; 1.0 everywhere else
    (serial, or not measured yet). Grammar-aware drafting prices the rows
    its drafts add to the scheduler's walk with it (in-process executor:
    the drafter's process holds the scheduler's manager)."""
    if manager is None or rows < MIN_ROWS or not _may_thread(manager):
        return 1.0
    c = getattr(manager, _CHOICE_ATTR, None)
    return 1.0 if c is None else c.ratio()


def row_ns(manager: Any) -> float | None:
    """What a verification row cost this manager's engine thread on its
    last walks (ns, wall time per row, the median; threaded or serial, as
    they ran), None before two walks. Grammar-aware drafting prices the rows
    its drafts add to the scheduler's walk with it (in-process executor;
    why: `vllm_patch.v1.spec_decode.draft_cost`)."""
    c = getattr(manager, _CHOICE_ATTR, None) if manager is not None else None
    if c is None or not c.walks:
        return None
    return statistics.median(c.walks)


def walk(manager: Any, walk_serial: Callable[..., Any], requests: Any,
         ids: list[str], spec: dict[str, list[int]], stride: int | None
         ) -> Any:
    """The batch's bitmask, its requests walked by `walk_serial` (stock's
    `grammar_bitmask`, or a wrapper of it) in chunks side by side. Same
    rows as one serial call; serial when `wanted` or `plan` says so. Each
    walk's wall time per row is recorded (`row_ns`)."""
    t0 = time.perf_counter_ns()
    counts = row_counts(ids, spec, stride)
    out = _walk(manager, walk_serial, requests, ids, spec, counts)
    choice(manager).record_walk(time.perf_counter_ns() - t0, sum(counts))
    return out


def _walk(manager: Any, walk_serial: Callable[..., Any], requests: Any,
          ids: list[str], spec: dict[str, list[int]], counts: list[int]
          ) -> Any:
    if not wanted(manager, ids):
        STATS.count(1)
        return walk_serial(manager, requests, ids, spec)
    ranges = plan(counts)
    if len(ranges) == 1:
        STATS.count(1)
        return walk_serial(manager, requests, ids, spec)
    decide = choice(manager)
    total = sum(counts)
    t0 = time.perf_counter_ns()
    if not decide.threaded():
        out = walk_serial(manager, requests, ids, spec)
        decide.record(False, time.perf_counter_ns() - t0, total)
        STATS.count(1)
        return out
    if manager._grammar_bitmask is None:
        # Sized as stock sizes it on its first call.
        k = manager.vllm_config.num_speculative_tokens
        manager._grammar_bitmask = manager.backend.allocate_token_bitmask(
            manager.vllm_config.scheduler_config.max_num_seqs * (1 + k))
    full = manager._grammar_bitmask
    if total > full.shape[0]:
        STATS.count(1)
        return walk_serial(manager, requests, ids, spec)
    offsets = np.concatenate(([0], np.cumsum(counts))).tolist()
    if type(manager.backend).__name__ == "GuidanceBackend":
        _guidance_walk(manager, walk_serial, requests, ids, spec, offsets, full)
        decide.record(True, time.perf_counter_ns() - t0, total)
        STATS.count(len(ranges))
        return full[:total].numpy()

    def chunk(lo: int, hi: int) -> None:
        _walk_range(manager, walk_serial, requests, ids, spec, offsets, full,
                    lo, hi)

    taken = itertools.count()  # next() is atomic under the GIL

    def drain() -> None:
        for i in iter(taken.__next__, None):
            if i >= len(ranges):
                return
            chunk(*ranges[i])

    pool = manager.executor_for_fillmask
    helpers = min(lanes(manager), len(ranges)) - 1
    futures: list[Future] = [pool.submit(drain) for _ in range(helpers)]
    error: BaseException | None = None
    try:
        drain()
    except BaseException as exc:  # noqa: BLE001 - re-raised after the others end
        error = exc
        for _ in range(len(ranges)):  # the other lanes take nothing more
            next(taken)
    for f in futures:  # every chunk ends before the step goes on
        try:
            f.result()
        except BaseException as exc:  # noqa: BLE001
            error = error or exc
    if error is not None:
        raise error
    decide.record(True, time.perf_counter_ns() - t0, total)
    STATS.count(len(ranges))
    return full[:total].numpy()


def _walk_range(manager: Any, walk_serial: Callable[..., Any], requests: Any,
                ids: list[str], spec: dict[str, list[int]], offsets: list[int],
                full: Any, lo: int, hi: int) -> None:
    """Requests ids[lo:hi] walked by `walk_serial` into their own rows of
    `full`: on a shallow copy of the manager whose bitmask is that slice."""
    view = copy.copy(manager)
    view._grammar_bitmask = full[offsets[lo]:offsets[hi]]
    walk_serial(view, requests, ids[lo:hi], spec)


def _ll_executor(manager: Any) -> Any:
    """llguidance's thread pool for this manager: as many threads as the
    threaded walk has lanes (vLLM's fill threads and the engine thread,
    which waits while the library walks)."""
    ex = getattr(manager, _LL_EXECUTOR_ATTR, None)
    if ex is None:
        from llguidance import LLExecutor

        ex = LLExecutor(num_threads=lanes(manager))
        setattr(manager, _LL_EXECUTOR_ATTR, ex)
    return ex


def _guidance_walk(manager: Any, walk_serial: Callable[..., Any],
                   requests: Any, ids: list[str], spec: dict[str, list[int]],
                   offsets: list[int], full: Any) -> None:
    """The batch's rows into `full`, walked by llguidance on its own threads
    where it fills them as stock does, by `walk_serial` on a request's own
    rows elsewhere (see the module's docstring)."""
    import llguidance.torch as llt

    drafted: list[tuple[Any, int, list[int]]] = []
    plain: list[tuple[Any, int]] = []
    grammars: list[Any] = []
    alone: set[int] = set()
    check_rows: list[int] = []
    check_tokens: list[int] = []
    owner: list[int] = []
    for i, rid in enumerate(ids):
        request = requests[rid]
        grammar = request.structured_output_request.grammar
        drafts = spec.get(rid) or []
        matcher = getattr(grammar, "ll_matcher", None)
        if (matcher is None or grammar.is_terminated() or matcher.is_stopped()
                or -1 in drafts or grammar.ll_tokenizer.eos_token in drafts
                or tuple(manager._get_constraint_bounds(request, drafts)) != (0, 0)):
            alone.add(i)
            continue
        grammars.append(grammar)
        row = offsets[i]
        if drafts:
            drafted.append((matcher, row, list(drafts)))
            check_rows.extend(range(row, row + len(drafts)))
            check_tokens.extend(drafts)
            owner.extend([i] * len(drafts))
        else:
            plain.append((matcher, row))
    executor = _ll_executor(manager)
    if drafted:
        llt.fill_next_token_bitmask_par_with_draft_tokens(executor, drafted, full)
    if plain:
        llt.fill_next_token_bitmask_par(executor, plain, full)
    if check_tokens:
        # A draft its row does not allow: stock's walk fails to accept it
        # and repeats that row after it; the library's later rows differ.
        rows = np.asarray(check_rows)
        tokens = np.asarray(check_tokens)
        words = full.numpy()[rows, tokens >> 5]
        refused = ((words >> (tokens & 31)) & 1) == 0
        alone.update(owner[j] for j in np.flatnonzero(refused).tolist())
    for i in sorted(alone):
        _walk_range(manager, walk_serial, requests, ids, spec, offsets, full,
                    i, i + 1)
    for grammar in grammars:
        grammar.check_error()  # as stock after a fill: logs an error once


def _make_grammar_bitmask(original: Any) -> Any:
    from vllm_patch import patching

    # 0.32 packs 1 + len(drafts) rows per request; 0.33 gives k + 1.
    packed = patching.version_series(patching.vllm_version()) == "0.32"

    def grammar_bitmask(self: Any, requests: Any,
                        structured_output_request_ids: list[str],
                        scheduled_spec_decode_tokens: dict[str, list[int]]):
        k = self.vllm_config.num_speculative_tokens
        if (not structured_output_request_ids or not k
                or self.vllm_config.model_config.is_diffusion):
            return original(self, requests, structured_output_request_ids,
                            scheduled_spec_decode_tokens)
        return walk(self, original, requests, structured_output_request_ids,
                    scheduled_spec_decode_tokens, None if packed else k + 1)

    return grammar_bitmask


PATCHES: list[Patch] = [
    Patch(
        name="parallel-verify-rows",
        guarantee="package",
        target="vllm.v1.structured_output:StructuredOutputManager.grammar_bitmask",
        versions=("0.32", "0.33"),
        signature=("self", "requests", "structured_output_request_ids",
                   "scheduled_spec_decode_tokens"),
        make=_make_grammar_bitmask,
        why=("with drafts, vLLM fills every structured request's bitmask rows "
             "on the engine thread (B x (k+1) fills per step, about 57 ms at "
             "B=256, k=4, a 131k vocabulary), its fill pool unused"),
        how=("a large xgrammar batch (a vocabulary of 64k tokens or more) is "
             "walked in contiguous request chunks "
             "by vLLM's own grammar_bitmask, on the engine thread and vLLM's "
             "fill threads; a large llguidance batch by llguidance's own "
             "batch walk on as many threads; where the manager's "
             "measurements say that is faster; the same rows as one serial "
             "walk (VLLM_PATCH_PARALLEL_VERIFY=0: serial)"),
        upstream="none",
        remove_when="vLLM fills speculative rows on its fill pool",
        pins=(pin(
            "vllm.v1.structured_output:StructuredOutputManager.grammar_bitmask",
            "row layout (0.32: 1 + len(drafts) rows per request, packed from "
            "row 0; 0.33: k + 1 rows per request); a request's walk touches "
            "only its own rows and grammar (rolled back after); the bitmask "
            "is allocated on first use as max_num_seqs * (1 + k) rows; "
            "returns the first rows of self._grammar_bitmask as numpy",
            on_build=True),
            pin("vllm.v1.structured_output:StructuredOutputManager."
                "_get_constraint_bounds",
                "(0, 0) when every row is constrained and every draft fed to "
                "the grammar (no reasoning before the constraint)"),
            pin("vllm.v1.structured_output.backend_guidance:"
                "GuidanceGrammar.accept_tokens",
                "a draft is consumed by self.ll_matcher; only a stop token "
                "(ll_tokenizer.eos_token) sets the grammar's own terminated "
                "state, which the library's walk does not see",
                on_build=True),
            pin("vllm.v1.structured_output.backend_guidance:"
                "GuidanceGrammar.fill_bitmask",
                "a row is llguidance's mask of self.ll_matcher (the stop "
                "token alone once stopped or in error), what the library's "
                "batch walk writes")),
    ),
]
