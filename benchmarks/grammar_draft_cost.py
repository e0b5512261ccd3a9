"""What grammar-aware drafting costs per engine step as the batch and the
vocabulary grow, next to stock vLLM's own grammar work under speculative
decoding, and what that means for output tokens per second on a GPU host.

One process, four modes interleaved step by step (the order rotates every
repetition), each with its own batch of requests, its own drafter and its
own committed grammars:

- stock: vLLM's own code only (what VLLM_PATCH_DISABLE=1 runs: no drafting
  hooks, vLLM's unpatched structured-output manager methods);
- off: patched, grammar-aware drafting switched off
  (VLLM_PATCH_MASKED_DRAFTS=0 VLLM_PATCH_FORCED_DRAFTS=0);
- default: patched defaults (the drafting cost model decides per step);
- always: patched, cost model off (VLLM_PATCH_DRAFT_COST_MODEL=0: every step
  drafts under the grammar, whatever it costs).

What runs per step and mode (thread CPU time, `time.thread_time`):
- verification, stock's own structured-spec-decoding grammar work on the
  engine thread: the scheduler trims the drafts to their grammar-valid
  prefix (`StructuredOutputManager.validate_tokens`), fills the bitmask rows
  of k+1 positions per request (`StructuredOutputManager.grammar_bitmask`
  with the scheduled drafts: accept, fill, rollback), then the committed
  grammars accept the step's tokens; also in the CPU time of every thread
  (`time.process_time`: a threaded walk's fill threads, vLLM's or
  llguidance's), which the table's total grammar CPU reads;
- drafting, on vLLM's own drafter class (`EagleProposer`): the runner's
  `prepare_next_token_ids_padded` (patched: the shadows advance), `propose`
  (patched: begin / rollback around it) and one `_sample_draft_tokens` call
  per draft position (patched: the walk under the grammar) on CPU logits of
  the real vocabulary size. The installed patched hooks run; only the model
  parts of vLLM's methods are replaced (the Triton kernel that computes the
  next token ids, the drafter's forward pass: the logits are given).

Grammars are real: JSONSchemaBench schemas from the MaskBench sample
(`../shared/data/jsonschemabench-dev/maskbench`) compiled by vLLM's
xgrammar or guidance backend for real tokenizers (mistral_common's Tekken,
131,072 tokens, and SentencePiece v3, 32,768; the tiny world's 8,192 when
it is built). Each request writes one of the schemas' valid instances
(compact JSON, tokenized as the model would), starting at a random point
of it, so grammar states are those of real documents. The "target" accepts
the drafts that equal the document's next tokens, then one more token. The
"drafter" prefers the document's next token with probability
--drafter-accuracy at each position while its drafts still follow the
document, else a random token (which the grammar mostly forbids: the case
grammar-aware drafting exists for).

Reported per cell (vocabulary, backend, k, batch size B), medians over the
timed repetitions (for the defaults mode, whose cost model walks on some
steps and not on others, the median of the steps that walked and the
median of those that did not, weighted by how many there were: a median
of the mixture is one regime's cost, not the mixture's, and a mean of the
paired differences is as noisy as the noisiest step; its share of rows
walked is a mean):
- verify_ms: stock's verification grammar work (the same code in every mode;
  measured in each), and verify_rows, the bitmask rows it filled;
- draft_cpu_ms: what grammar-aware drafting adds over stock's drafting step
  and stays on the CPU on a GPU host: the mode's drafting time minus stock's
  in the same repetition, minus the tensor work the feature runs on the
  logits' device (its `device_ns` counter: top-k, gathers, masked argmax,
  GPU work on a GPU host);
- h2d / d2h bytes and device-to-host syncs per step (the package's counters);
- one-off shadow compiles (outside the steady-state figures);
- simulated tokens per step and the cost model's share of steps on.

Projection (a model, not a GPU measurement): output tokens/s =
B x tokens_per_step / (GPU step + CPU grammar work on the engine thread),
GPU step 10 / 20 / 30 ms. The grammar work: each mode's verification rows
priced at stock's measured cost per row in the same cell, plus the mode's
own drafting CPU (two lanes timing the same verification work differ by up
to about 10 %, more than the feature costs when it is off); the projection
from the raw timings is in the JSON (`measured_20ms`). Tokens per target step come from the tiny world's
end-to-end figures (--tokens-from, defaults below); the defaults mode gets
stock's figure on the steps its cost model kept stock.

    python benchmarks/grammar_draft_cost.py --quick                 # < 30 s
    python benchmarks/grammar_draft_cost.py --vocabs tekken --json /tmp/c.json
    python benchmarks/grammar_draft_cost.py --profile               # hot spots
    python benchmarks/grammar_draft_cost.py --floor --vocabs 131k --backends xgrammar --k 4 --batch 256
                                         # + the grammar library's own calls in it

Verification threads as vLLM would run them (--verify-threads auto, the
default): the patched lanes' scheduler gets vLLM's fill pool where vLLM
builds it (max_num_seqs > 128; max_num_seqs is B here), so the package's
threaded verification rows run where its own measurements choose them
(xgrammar, at least 128 rows); stock fills its rows serially. A threaded
lane's row is priced at stock's cost per row times the lane's measured wall
time per row over stock's (what the threads really cost here, the waits
included); `verify_row_factor` keeps what the scheduler's own measurements
claimed (threaded / serial wall per row), the price the drafting cost
model reads. `on` / `off` give every cell the pool or none. The verification
is timed in wall time too (`verify_wall_ms`, projected as `wall_20ms`):
meaningful on an idle machine only (the lock keeps other benchmarks off,
not other work).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODES = ("stock", "off", "default", "always")
MODE_ENV = {
    "stock": {},
    "off": {"VLLM_PATCH_MASKED_DRAFTS": "0", "VLLM_PATCH_FORCED_DRAFTS": "0"},
    "default": {},
    "always": {"VLLM_PATCH_DRAFT_COST_MODEL": "0"},
}
FLAGS = ("VLLM_PATCH_MASKED_DRAFTS", "VLLM_PATCH_FORCED_DRAFTS",
         "VLLM_PATCH_DRAFT_COST_MODEL")
VOCABS = {"tiny": "tiny", "32k": "spm", "131k": "tekken"}
GPU_STEPS_MS = (10.0, 20.0, 30.0)
# Tokens per target step, the tiny world's end-to-end benchmark
# (benchmarks/grammar_spec_decode.py, README: greedy, k=4, structured
# requests): 1 / target passes per output token.
DEFAULT_TOKENS = {
    "perfect": {"stock": round(1 / 0.555, 2), "patched": 4.98},
    "eagle": {"stock": round(1 / 0.733, 2), "patched": round(1 / 0.450, 2)},
    "draft": {"stock": round(1 / 0.739, 2), "patched": round(1 / 0.481, 2)},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="grammar_draft_cost.py",
        description="CPU cost per engine step of grammar-aware drafting and of "
                    "stock's structured spec-decoding grammar work, with a "
                    "projection of output tokens/s on a GPU host (a model).")
    ap.add_argument("--vocabs", default="32k,131k",
                    help="comma-separated subset of tiny (8k; needs the tiny world), "
                         "32k, 131k (default 32k,131k; tiny is added when built)")
    ap.add_argument("--backends", default="xgrammar,guidance")
    ap.add_argument("--batch", default="1,8,32,128,256", help="batch sizes B")
    ap.add_argument("--k", default="1,4,7", help="draft tokens per step")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions (default 7)")
    ap.add_argument("--warmup", type=int, default=24,
                    help="warm-up steps (default 24: at large batches the cost model settles, or goes dormant, within about 15)")
    ap.add_argument("--schemas", type=int, default=64,
                    help="MaskBench schemas with a valid instance (default 64)")
    ap.add_argument("--min-tokens", type=int, default=48,
                    help="instances at least this long (default 48 tokens)")
    ap.add_argument("--drafter-accuracy", type=float, default=0.7,
                    help="simulated drafter: P(its first choice is the document's "
                         "next token) while it follows the document (default 0.7)")
    ap.add_argument("--drafter-second", type=float, default=0.5,
                    help="simulated drafter: P(the document's token is its second "
                         "choice) where its first is wrong (default 0.5)")
    ap.add_argument("--gpu-step-ms", type=float, default=20.0,
                    help="the GPU step the cost model sees (default 20)")
    ap.add_argument("--tokens-from", default=None,
                    help="JSON {drafter: {stock: t, patched: t}} tokens per target "
                         "step (default: the tiny world's README figures)")
    ap.add_argument("--cpu-path", action="store_true",
                    help="the drafting path of a CPU device (lazy top-k) instead "
                         "of the accelerator's (top-k candidates up front)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verify-threads", choices=("auto", "on", "off"),
                    default="auto", nargs="?", const="on",
                    help="vLLM's fill pool (half the cores, at most 8) for the "
                         "patched lanes' scheduler, so the package's threaded "
                         "verification rows run where its own measurements "
                         "choose them (xgrammar, at least 128 rows): auto "
                         "(default) where vLLM builds the pool, max_num_seqs "
                         "(= B here) > 128; on: every cell; off: none. The "
                         "projection and the cost model price the rows at "
                         "the measured threaded share (`verify_row_factor`)")
    ap.add_argument("--quick", action="store_true",
                    help="a few cells (32k xgrammar, k=4, B=1,8,32; 3 reps)")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile one always-on cell (131k xgrammar, k=4, B=256 "
                         "unless --batch/--k/--vocabs say otherwise) and print "
                         "the hot spots")
    ap.add_argument("--floor", action="store_true",
                    help="also time the grammar library's own calls inside the "
                         "always-on lane's drafting (xgrammar: its batched "
                         "accepts and rollbacks, jump-forward strings, fills; "
                         "guidance: its tries and vLLM's grammar calls, the "
                         "library plus vLLM's Python around it): per step, the part of the "
                         "drafting CPU that no change to the Python around "
                         "them removes")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--render", nargs="+", default=None, metavar="JSON",
                    help="print the table of earlier runs' JSON files and exit")
    args = ap.parse_args(argv)
    if args.quick:
        args.vocabs, args.backends, args.k = "32k", "xgrammar", "4"
        args.batch, args.reps, args.warmup, args.schemas = "1,8,32", 3, 4, 16
    if args.profile and args.batch == ap.get_default("batch"):
        args.batch, args.k, args.vocabs, args.backends = "256", "4", "131k", "xgrammar"
    return args


def maskbench() -> Path:
    """The MaskBench sample (VLLM_PATCH_JSONSCHEMABENCH, else
    ../shared/data/jsonschemabench-dev next to the repository, else
    /work/shared/data/jsonschemabench-dev)."""
    from vllm_patch.testing.jsonschemabench import ENV, MASKBENCH

    for path in (Path(MASKBENCH) if os.environ.get(ENV) else None,
                 REPO.parent / "shared" / "data" / "jsonschemabench-dev" / "maskbench",
                 Path("/work/shared/data/jsonschemabench-dev/maskbench"),
                 Path(MASKBENCH)):
        if path is not None and path.is_dir():
            return path
    raise LookupError("MaskBench sample not found (set VLLM_PATCH_JSONSCHEMABENCH)")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _original(func: Any) -> Any:
    from vllm_patch.patching import ORIGINAL_ATTR

    return getattr(func, ORIGINAL_ATTR, func)


# ---------------------------------------------------------------- the world

class World:
    """One vocabulary and backend: tokenizer, vLLM backend, the scheduler's
    structured-output managers (patched class and stock methods), documents."""

    def __init__(self, vocab: str, kind: str, args: argparse.Namespace) -> None:
        import torch
        from vllm.v1.structured_output import StructuredOutputManager

        from vllm_patch.testing.vocabularies import (load_tokenizer, make_backend,
                                                     vocab_size)
        from vllm_patch.v1.spec_decode import grammar_drafts as gd

        self.vocab, self.kind = vocab, kind
        self.tokenizer = load_tokenizer(VOCABS[vocab])
        if self.tokenizer is None:
            raise LookupError("the tiny world is not built")
        self.backend = make_backend(kind, self.tokenizer)
        self.size = vocab_size(self.tokenizer)
        self.eos = self.tokenizer.eos_token_id
        M = StructuredOutputManager
        stock_cls = type("StockStructuredOutputManager", (M,), {
            name: _original(getattr(M, name)) for name in
            ("grammar_bitmask", "_fill_bitmasks", "validate_tokens")})
        self.managers = {}
        pool = None
        self.threads = getattr(args, "verify_threads", "auto")
        if self.threads in ("auto", "on", True):
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(
                max_workers=max(1, min((os.cpu_count() or 1) // 2, 8)))
        for mode in MODES:
            cls = stock_cls if mode == "stock" else M
            m = cls.__new__(cls)
            m.backend = self.backend
            m.reasoner_cls = None
            m.enable_in_reasoning = False
            m._grammar_bitmask = None
            m._full_mask = torch.tensor(-1, dtype=torch.int32)
            m.fill_bitmask_parallel_threshold = 128
            m.executor_for_fillmask = None
            m.fill_bitmask_parallel_batch_size = 16
            m.tokenizer = self.tokenizer
            m._use_async_grammar_compilation = False
            self.managers[mode] = m
            if mode != "stock":
                # The in-process executor: the drafter finds the scheduler's
                # manager (as the patched __init__ registers it).
                gd.MANAGERS.add(m)
        self.pool = pool
        self.docs = self._documents(args)
        if not self.docs:
            raise LookupError(f"no instance compiles and validates with {kind}")
        self.gd = gd

    def config(self, mode: str, k: int, batch: int) -> Any:
        so = SimpleNamespace(reasoning_parser="", enable_in_reasoning=False,
                             reasoning_parser_plugin="", backend=self.kind,
                             disable_any_whitespace=False)
        size = self.size
        model = SimpleNamespace(get_vocab_size=lambda: size, is_diffusion=False,
                                skip_tokenizer_init=False)
        cfg = SimpleNamespace(
            structured_outputs_config=so, model_config=model,
            num_speculative_tokens=k,
            scheduler_config=SimpleNamespace(max_num_seqs=batch),
            speculative_config=SimpleNamespace(num_speculative_tokens=k),
            parallel_config=SimpleNamespace(distributed_executor_backend=None))
        m = self.managers[mode]
        m.vllm_config = cfg
        m._grammar_bitmask = None  # sized for (batch, k)
        # vLLM builds its fill pool when max_num_seqs > 128 (stock never
        # uses it with drafts); each cell measures its own threaded walk.
        threads = self.threads in ("on", True) or (
            self.threads == "auto" and batch > 128)
        m.executor_for_fillmask = self.pool if threads and mode != "stock" \
            else None
        from vllm_patch.v1.structured_output import parallel_rows

        m.__dict__.pop(parallel_rows._CHOICE_ATTR, None)
        return cfg

    def _documents(self, args: argparse.Namespace) -> list[tuple[str, list[int]]]:
        from vllm_patch.testing.jsonschemabench import maskbench_entries
        from vllm_patch.v1.spec_decode.forced_drafts import vocab_for

        out = []
        for spec, g, valid in maskbench_entries(self.backend, maskbench()):
            vocab = vocab_for(g, self.tokenizer)
            for data in valid:
                text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
                ids = vocab.encode_after(text)
                if ids is None or len(ids) < args.min_tokens:
                    continue
                g.reset()
                if hasattr(g, "terminated"):
                    g.terminated = False
                if len(g.validate_tokens(ids + [self.eos])) == len(ids) + 1:
                    out.append((spec, ids))
                    break
            if len(out) >= args.schemas:
                break
        return out


# ------------------------------------------------------------------ a batch

class _Model:
    """The drafter's model: its hidden states are the logits."""

    def compute_logits(self, hidden_states: Any) -> Any:
        return hidden_states


_ARGMAX = {"ns": 0}


# --floor: the grammar library's calls inside the always-on lane's drafting
# (timed steps only), per call site: thread CPU ns, calls, tokens.
_FLOOR: dict[str, Any] = {"on": False, "ns": {}, "calls": {}, "items": {}}


def _floor_count(name: str, t0: int, items: int = 0) -> None:
    ns = time.thread_time_ns() - t0
    f = _FLOOR
    f["ns"][name] = f["ns"].get(name, 0) + ns
    f["calls"][name] = f["calls"].get(name, 0) + 1
    f["items"][name] = f["items"].get(name, 0) + items


def _floor_timed(name: str, func: Any, items: Any = None) -> Any:
    def timed(*a: Any, **kw: Any) -> Any:
        if not _FLOOR["on"]:
            return func(*a, **kw)
        t0 = time.thread_time_ns()
        try:
            return func(*a, **kw)
        finally:
            _floor_count(name, t0, items(a) if items is not None else 0)
    return timed


def _install_floor(gd: Any) -> None:
    """Wrap the library calls the drafter makes (once per process)."""
    if _FLOOR.get("installed"):
        return
    _FLOOR["installed"] = True
    import xgrammar as xgr

    api = gd._batch_api()
    if api is not None:
        class _Batch:  # the raw handle API grammar_drafts calls
            batch_accept_token = staticmethod(_floor_timed(
                "xgrammar batch_accept_token", api.batch_accept_token,
                lambda a: len(a[1])))
            batch_rollback = staticmethod(_floor_timed(
                "xgrammar batch_rollback", api.batch_rollback, lambda a: len(a[0])))

            def __getattr__(self, name: str) -> Any:
                return getattr(api, name)
        gd._BATCH = _Batch()
    gm = xgr.GrammarMatcher
    for name, items in (("accept_token", lambda a: 1), ("rollback", None),
                        ("find_jump_forward_string", None),
                        ("fill_next_token_bitmask", lambda a: 1)):
        setattr(gm, name, _floor_timed(f"xgrammar {name}", getattr(gm, name), items))
    bgm = xgr.BatchGrammarMatcher
    bgm.batch_fill_next_token_bitmask = _floor_timed(
        "xgrammar batch_fill_next_token_bitmask", bgm.batch_fill_next_token_bitmask,
        lambda a: len(a[1]))
    if gd._guidance_accepts is not None:  # a guidance shadow's try: one call
        gd._guidance_accepts = _floor_timed(
            "llguidance try_consume_tokens (a try)", gd._guidance_accepts,
            lambda a: len(a[1]))
    try:
        from vllm.v1.structured_output.backend_guidance import GuidanceGrammar
    except ImportError:
        return
    for name, items in (("accept_tokens", lambda a: len(a[2])),
                        ("validate_tokens", lambda a: len(a[1])),
                        ("rollback", None), ("fill_bitmask", lambda a: 1),
                        ("is_terminated", None)):
        setattr(GuidanceGrammar, name, _floor_timed(
            f"vLLM guidance {name}", getattr(GuidanceGrammar, name), items))


def floor_table(cell: dict[str, Any]) -> str:
    f = cell.get("floor")
    if not f:
        return ""
    lines = [f"Library calls inside the always-on lane's drafting, {cell['vocab']} "
             f"{cell['backend']}, k={cell['k']}, B={cell['batch']}, per timed step "
             f"(thread CPU; drafting CPU {f['draft_cpu_ms']:.2f} ms):",
             "| call | ms per step | calls per step | tokens or rows per step | us each |",
             "|---|---|---|---|---|"]
    for name, row in sorted(f["calls"].items(), key=lambda x: -x[1]["ms"]):
        each = row["ms"] * 1e3 / row["items"] if row["items"] else \
            row["ms"] * 1e3 / max(row["calls"], 1e-9)
        lines.append(f"| {name} | {row['ms']:.2f} | {row['calls']:.1f} | "
                     f"{row['items']:.0f} | {each:.2f} |")
    lines.append(f"| all library calls | {f['library_ms']:.2f} | | | |")
    return "\n".join(lines)


def _timed_logits_class() -> Any:
    """A tensor whose argmax is timed apart: the drafter's own argmax over
    the logits (stock's, kept by the patched path) is GPU work on a GPU
    host, common to every mode; timing it apart keeps the modes' host-side
    differences out of its noise. Every other op is a plain tensor's."""
    import torch

    class TimedLogits(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl

        def argmax(self, *a: Any, **kw: Any) -> Any:
            t0 = time.thread_time_ns()
            try:
                return torch.Tensor.argmax(self, *a, **kw)
            finally:
                _ARGMAX["ns"] += time.thread_time_ns() - t0

    return TimedLogits


class Lane:
    """One mode's batch: requests, committed grammars, drafter."""

    def __init__(self, world: World, mode: str, k: int, batch: int,
                 rng: random.Random, args: argparse.Namespace) -> None:
        import torch
        from vllm.v1.spec_decode.eagle import EagleProposer

        from vllm_patch.testing.harness import bare_eagle_proposer
        from vllm_patch.v1.spec_decode import llm_base_proposer as lbp

        self.world, self.mode, self.k, self.batch, self.rng = world, mode, k, batch, rng
        # Every random choice is a function of the batch row, the row's
        # request generation and the document position (not of a stream
        # the lanes share in order): a row whose state is stock's makes
        # stock's choices in every mode, so lanes differ only where a mode's
        # drafting changed a request's course.
        self.seed = args.seed
        self.gen = [0] * batch
        self.accuracy = args.drafter_accuracy
        self.second = args.drafter_second
        self.config = world.config(mode, k, batch)
        self.manager = world.managers[mode]
        d = bare_eagle_proposer(self.config, _Model(), k)
        self.drafter = d
        self.serial = 0
        self.reqs: list[dict[str, Any]] = []
        self.requests: dict[str, Any] = {}   # the runner's request states
        self.sched: dict[str, Any] = {}      # the scheduler's requests
        for row in range(batch):
            self.reqs.append(self._new_request(row, start=None))
        self.drafts: list[list[int]] = [[] for _ in range(batch)]
        self.sampled: list[list[int]] = [[] for _ in range(batch)]
        self.tracker = None
        self.logits_class = _timed_logits_class()
        self.compile_ns = 0
        self.step_tokens: list[int] = []
        if mode == "stock":
            self.sample = _original(EagleProposer._sample_draft_tokens)
            self.prepare = _prepare_stub
            self.propose = _propose_loop
        else:
            self.sample = EagleProposer._sample_draft_tokens  # patched
            self.prepare = lbp._make_prepare_padded(_prepare_stub)
            self.propose = lbp._make_propose(_propose_loop)

    def _new_request(self, row: int, start: int | None) -> dict[str, Any]:
        from vllm.sampling_params import StructuredOutputsParams
        from vllm.v1.structured_output.backend_types import StructuredOutputOptions

        self.gen[row] += 1
        rng = random.Random(f"{self.seed}:{row}:{self.gen[row]}")
        spec, ids = self.world.docs[rng.randrange(len(self.world.docs))]
        if start is None:
            start = rng.randrange(0, max(1, len(ids) // 2))
        self.serial += 1
        rid = f"{self.mode}-{self.serial}"
        g = self.world.backend.compile_grammar(StructuredOutputOptions.JSON, spec)
        if start:
            assert g.accept_tokens(rid, ids[:start])
        params = SimpleNamespace(structured_outputs=StructuredOutputsParams(json=spec),
                                 all_stop_token_ids={self.world.eos})
        self.requests[rid] = SimpleNamespace(sampling_params=params,
                                             output_token_ids=list(ids[:start]))
        self.sched[rid] = SimpleNamespace(
            request_id=rid, use_structured_output=True, all_token_ids=[],
            structured_output_request=SimpleNamespace(
                grammar=g, reasoning_ended=None, reasoner=None))
        return {"rid": rid, "ids": ids, "pos": start}

    # -- stock's verification (scheduler side) -----------------------------
    def verify(self) -> int:
        """The scheduler's grammar work for this step's drafts; then the
        step's tokens (the accepted drafts and one more) are committed.
        Returns its thread CPU time (ns)."""
        rids = [r["rid"] for r in self.reqs]
        w0 = time.perf_counter_ns()
        c0 = time.process_time_ns()
        t0 = time.thread_time_ns()
        spec: dict[str, list[int]] = {}
        for r, drafts in zip(self.reqs, self.drafts):
            if drafts:
                spec[r["rid"]] = self.manager.validate_tokens(
                    self.sched[r["rid"]], drafts)
        self.manager.grammar_bitmask(self.sched, rids, spec)
        ns = time.thread_time_ns() - t0
        # The bitmask rows this step's verification filled: its work, free of
        # timing noise (one per request and scheduled draft).
        self.verify_rows = sum(len(spec.get(rid, ())) + 1 for rid in rids)
        self.sampled = []
        self.step_tokens = []
        for r in self.reqs:
            ids, pos = r["ids"], r["pos"]
            scheduled = spec.get(r["rid"], [])
            n = 0
            while n < len(scheduled) and pos + n < len(ids) \
                    and scheduled[n] == ids[pos + n]:
                n += 1
            tokens = ids[pos:pos + n + 1]
            self.sampled.append(tokens)
            self.step_tokens.append(len(tokens))
        t0 = time.thread_time_ns()
        for r, tokens in zip(self.reqs, self.sampled):
            g = self.sched[r["rid"]].structured_output_request.grammar
            if tokens:
                assert g.accept_tokens(r["rid"], tokens), (r["rid"], tokens)
        # Wall time too: with --verify-threads part of the work runs on
        # vLLM's fill threads, outside the engine thread's CPU time.
        self.verify_wall_ns = time.perf_counter_ns() - w0
        # And the CPU time of every thread (the fill threads' included).
        self.verify_all_cpu_ns = time.process_time_ns() - c0
        return ns + time.thread_time_ns() - t0

    def retire(self) -> None:
        """Requests at their document's end leave; new ones take their rows
        (their committed grammar compiles off the engine thread in vLLM:
        not timed)."""
        for i, r in enumerate(self.reqs):
            r["pos"] += len(self.sampled[i])
            if r["pos"] >= len(r["ids"]):
                del self.requests[r["rid"]]
                del self.sched[r["rid"]]
                self.reqs[i] = self._new_request(i, start=0)
                self.sampled[i] = []

    # -- drafting (worker side) --------------------------------------------
    def draft(self, logits: Any) -> tuple[int, int]:
        """prepare_next_token_ids_padded, then propose with k positions.
        Returns (thread CPU ns, of which building the given logits)."""
        import torch

        k, b = self.k, self.batch
        sampled = torch.full((b, k + 1), -1, dtype=torch.int32)
        for i, tokens in enumerate(self.sampled):
            if tokens:
                sampled[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        batch = SimpleNamespace(req_ids=[r["rid"] for r in self.reqs],
                                num_reqs=b, vocab_size=self.world.size)
        discard = torch.zeros(b, dtype=torch.bool)
        lane = self
        lane.logits_ns = 0
        t0 = time.thread_time_ns()
        self.prepare(self.drafter, sampled, self.requests, batch, discard)
        cad = SimpleNamespace(batch_size=lambda: b)
        drafts = self.propose(self.drafter, k, None, None, None, None, None,
                              common_attn_metadata=cad, sampling_metadata=None,
                              lane=lane, logits=logits)
        out = SimpleNamespace(req_ids=batch.req_ids, draft_token_ids=drafts)
        limits = self.world.gd.take_limits(self.drafter)
        out = self.world.gd.trim_drafts(out, limits)
        ns = time.thread_time_ns() - t0
        self.drafts = [list(x) for x in out.draft_token_ids]
        # The runner's request states now hold this step's tokens.
        for r, tokens in zip(self.reqs, self.sampled):
            self.requests[r["rid"]].output_token_ids.extend(tokens)
        return ns, lane.logits_ns

    def preferred(self, j: int, following: list[bool]
                  ) -> tuple[list[int], list[int], list[int]]:
        """The drafter's preferred token per row at draft position j, and its
        second best (-1: none). While its drafts follow the document it
        prefers the document's next token with probability `accuracy`;
        otherwise a random token, with the document's token second with
        probability `second` (what masking can recover); after it left the
        document, random tokens. Third: the document's token (-1: none)."""
        first, second, docs = [], [], []
        size = self.world.size
        for i, r in enumerate(self.reqs):
            at = r["pos"] + len(self.sampled[i]) + j
            doc = r["ids"][at] if at < len(r["ids"]) else None
            docs.append(-1 if doc is None else doc)
            # This row's choices at this point of its document (the same in
            # every mode; ints hash to themselves, tuples deterministically).
            key = (self.seed, i, self.gen[i], at)
            u_first = (hash(key + (1,)) & 0xFFFFFF) / 0x1000000
            u_second = (hash(key + (2,)) & 0xFFFFFF) / 0x1000000
            other = hash(key + (3,)) % size
            if following[i] and doc is not None and u_first < self.accuracy:
                first.append(doc)
                second.append(-1)
                continue
            first.append(other)
            second.append(doc if following[i] and doc is not None
                          and u_second < self.second else -1)
        return first, second, docs


def _prepare_stub(self: Any, sampled_token_ids: Any, requests: Any,
                  gpu_input_batch: Any, discard_request_mask: Any) -> Any:
    """vLLM's prepare_next_token_ids_padded without its Triton kernel: the
    last valid sampled token per row and the count of valid ones."""
    import torch

    valid = sampled_token_ids >= 0
    count = valid.sum(dim=1).to(torch.int32)
    idx = (count.long() - 1).clamp(min=0)
    nxt = sampled_token_ids.gather(1, idx.unsqueeze(1)).squeeze(1)
    return nxt, count


def _propose_loop(self: Any, num_speculative_tokens: int, *args: Any,
                  common_attn_metadata: Any = None, sampling_metadata: Any = None,
                  lane: Any = None, logits: Any = None, **kwargs: Any) -> list:
    """vLLM's propose with the drafter's forward pass replaced by given
    logits: per draft position, `_sample_draft_tokens` on them (the patched
    hook in the patched modes), the drafts stacked to [B, k]."""
    import torch

    meta = SimpleNamespace(all_greedy=True)
    b = common_attn_metadata.batch_size()
    timed = logits.as_subclass(lane.logits_class)
    following = [True] * b
    cols = []
    rows = torch.arange(b)
    for j in range(num_speculative_tokens):
        t0 = time.thread_time_ns()
        first, second, docs = lane.preferred(j, following)
        pref = torch.tensor(first, dtype=torch.long)
        alt = [(i, tok) for i, tok in enumerate(second) if tok >= 0 and tok != first[i]]
        alt_rows = torch.tensor([i for i, _ in alt], dtype=torch.long)
        alt_toks = torch.tensor([tok for _, tok in alt], dtype=torch.long)
        saved = logits[rows, pref].clone()
        saved_alt = logits[alt_rows, alt_toks].clone()
        logits[alt_rows, alt_toks] = 1e3
        logits[rows, pref] = 1e4
        lane.logits_ns += time.thread_time_ns() - t0
        ids, _ = lane.sample(self, timed, meta)
        t0 = time.thread_time_ns()
        logits[rows, pref] = saved
        logits[alt_rows, alt_toks] = saved_alt
        mine = ids.tolist()
        following = [f and mine[i] == docs[i] for i, f in enumerate(following)]
        lane.logits_ns += time.thread_time_ns() - t0
        cols.append(ids)
    return torch.stack(cols, dim=1).tolist()


# ---------------------------------------------------------------- one cell

def _with_env(mode: str):
    class _Env:
        def __enter__(self):
            self.saved = {f: os.environ.get(f) for f in FLAGS}
            for f in FLAGS:
                os.environ.pop(f, None)
            os.environ.update(MODE_ENV[mode])

        def __exit__(self, *exc):
            for f, v in self.saved.items():
                if v is None:
                    os.environ.pop(f, None)
                else:
                    os.environ[f] = v
    return _Env()


def run_cell(world: World, k: int, batch: int, args: argparse.Namespace,
             modes: tuple[str, ...] = MODES, profile: Any = None) -> dict[str, Any]:
    import torch

    from vllm_patch import envs

    floor_steps = None
    if getattr(args, "floor", False):
        _install_floor(world.gd)
        for key in ("ns", "calls", "items"):
            _FLOOR[key] = {}
        floor_steps = args.reps

    gd = world.gd
    gd.CANDIDATES_UPFRONT = None if args.cpu_path else True
    torch.manual_seed(args.seed)
    logits = torch.randn(batch, world.size)
    lanes = {}
    for mode in modes:
        # The same seed in every mode: the same documents, starting points
        # and drafter choices (until a mode's drafts differ).
        lane = Lane(world, mode, k, batch, random.Random(args.seed), args)
        if mode != "stock":
            with _with_env(mode):
                gd.tracker(lane.drafter)
            lane.tracker = lane.drafter.__dict__.get(gd.TRACKER_ATTR)
            if lane.tracker is not None and lane.tracker.cost is not None:
                # A GPU host's synchronisation price (0 on a CPU device).
                lane.tracker.cost.sync_ns = envs.settings().draft_sync_us * 1e3
        lanes[mode] = lane
    per: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    # Every step's, warm-up included: what a batch pays from its start (the
    # cost model's first measuring steps, the shadows' advance until it goes
    # dormant), to be amortized over the dormant period that follows.
    totals = {m: {"draft_cpu_ms": 0.0, "verify_rows": 0.0} for m in modes}
    last_draft = {m: 0.0 for m in modes}
    stock_row_ns: list[float] = []
    compile_ms = {m: 0.0 for m in modes}
    order = list(modes)
    steps = args.warmup + args.reps
    for step in range(steps):
        timed = step >= args.warmup
        order = order[1:] + order[:1]
        rep: dict[str, dict[str, float]] = {}
        for mode in order:
            lane = lanes[mode]
            verify_ns = lane.verify()
            if mode == "stock":
                stock_row_ns.append(verify_ns / max(lane.verify_rows, 1))
            t = lane.tracker
            before = dict(t.stats) if t is not None else {}
            if t is not None and t.cost is not None:
                # The cost model sees a GPU host's step, as on an engine
                # between two of its drafting steps: the GPU's time, the
                # last drafting step's CPU work and the verification of its
                # drafts (this repetition's rows, priced as the projection
                # prices them: at stock's measured cost per row, times the
                # share of it the lane's threaded walk took this step; two
                # lanes timing the same rows differ by 10 % and more).
                share = min(1.0, lane.verify_wall_ns / max(verify_ns, 1))
                per_row = statistics.median(stock_row_ns) if stock_row_ns \
                    else verify_ns / max(lane.verify_rows, 1)
                verify_ms = per_row * lane.verify_rows * share / 1e6
                t.cost.bench_step_ns = int(
                    (args.gpu_step_ms + verify_ms + last_draft[mode]) * 1e6)
            on_before = dict(t.cost.counts) if t is not None and t.cost else {}
            gd_compile_before = _COMPILE["ns"]
            argmax_before = _ARGMAX["ns"]
            if profile is not None and timed and mode == "always":
                profile.enable()
            _FLOOR["on"] = floor_steps is not None and timed and mode == "always"
            draft_ns, logits_ns = lane.draft(logits)
            _FLOOR["on"] = False
            if profile is not None:
                profile.disable()
            comp = _COMPILE["ns"] - gd_compile_before
            argmax_ns = _ARGMAX["ns"] - argmax_before
            after = dict(t.stats) if t is not None else {}
            delta = {key: after[key] - before.get(key, 0) for key in after}
            if t is not None and t.cost is not None:
                # On a GPU host the tensor work runs on the GPU (queued, not
                # waited for): the cost model sees the host's share only.
                t.cost.host_ns = max(0, t.cost.host_ns - delta.get("device_ns", 0)
                                     - comp - argmax_ns)
                # The one-off compiles are in the shadows' upkeep.
                t.cost.upkeep_ns = max(0, t.cost.upkeep_ns - comp)
            row = {
                "verify_ms": verify_ns / 1e6,
                "verify_wall_ms": lane.verify_wall_ns / 1e6,
                "verify_all_cpu_ms": lane.verify_all_cpu_ns / 1e6,
                "verify_rows": lane.verify_rows,
                # The drafting step's host time without the drafter's own
                # argmax (GPU work, common to every mode).
                "draft_ms": (draft_ns - logits_ns - comp - argmax_ns) / 1e6,
                "argmax_ms": argmax_ns / 1e6,
                "device_ms": delta.get("device_ns", 0) / 1e6,
                "h2d_bytes": delta.get("h2d_bytes", 0),
                "d2h_bytes": delta.get("d2h_bytes", 0),
                "d2h_syncs": delta.get("d2h_syncs", 0),
                "tokens_per_step": statistics.fmean(lane.step_tokens),
                # What the cost model counted as the walk's gain (accepted
                # drafts after the first changed position), per row.
                "gain_per_row": delta.get("gain_tokens", 0) / batch,
            }
            if t is not None and t.cost is not None and not t.reason_off:
                # The share of the batch's rows that walked the grammar in
                # this step (all of them on, a sample when measuring or
                # probing, none off or dormant).
                row["on"] = (t.cost.rows / batch) if t.cost.walked else 0.0
                row["regime"] = t.cost.regime
            compile_ms[mode] += comp / 1e6
            rep[mode] = row
            lane.retire()
        stock = rep.get("stock")
        for mode, row in rep.items():
            if stock is not None:
                # Paired with stock's step in the same repetition; not
                # clipped per step (a median of clipped differences reads a
                # cost of nothing as a positive one): the median is.
                row["draft_cpu_ms"] = (row["draft_ms"] - stock["draft_ms"]
                                       - row["device_ms"]) if mode != "stock" else 0.0
            # Every thread's grammar CPU: the fill threads' too.
            grammar = row["verify_all_cpu_ms"] + row.get("draft_cpu_ms", 0.0)
            last_draft[mode] = max(0.0, row.get("draft_cpu_ms", 0.0))
            row["grammar_cpu_ms"] = grammar
            totals[mode]["draft_cpu_ms"] += row.get("draft_cpu_ms", 0.0)
            totals[mode]["verify_rows"] += row["verify_rows"]
            if timed:
                for key, v in row.items():
                    if isinstance(v, (int, float)):
                        per[mode].setdefault(key, []).append(float(v))
    out: dict[str, Any] = {"vocab": world.vocab, "vocab_size": world.size,
                           "backend": world.kind, "k": k, "batch": batch,
                           "reps": args.reps, "modes": {}}
    for mode in modes:
        med = {key: statistics.median(v) for key, v in per[mode].items()}
        walked = [x > 0 for x in per[mode].get("on", [])]
        if mode == "default" and any(walked) and not all(walked):
            # A mixture of regimes (walking steps, stock's drafts): each
            # regime's median, weighted by its share of the steps.
            share = sum(walked) / len(walked)
            for key, v in per[mode].items():
                on = [x for x, w in zip(v, walked) if w]
                off = [x for x, w in zip(v, walked) if not w]
                med[key] = share * statistics.median(on) \
                    + (1 - share) * statistics.median(off)
        if "draft_cpu_ms" in med:
            med["draft_cpu_ms"] = max(0.0, med["draft_cpu_ms"])
            med["grammar_cpu_ms"] = med["verify_all_cpu_ms"] + med["draft_cpu_ms"]
        t = lanes[mode].tracker
        med["shadow_compile_ms_total"] = compile_ms[mode]
        med["all_steps"] = {"steps": steps, **totals[mode]}
        med["shadows"] = t.stats["shadows"] if t is not None else 0
        if "on" in per[mode] and t is not None:
            med["on_share"] = statistics.fmean(per[mode]["on"])
            med["regime_last"] = t.cost.regime
        # What a verification row costs the engine thread as a share of a
        # serial one: the scheduler's own measured threaded / serial ratio
        # where its walk runs threaded (the same price the cost model reads).
        from vllm_patch.v1.structured_output import parallel_rows

        med["verify_row_factor"] = 1.0 if mode == "stock" else \
            parallel_rows.row_factor(lanes[mode].manager,
                                     int(med.get("verify_rows", 0)))
        # Threads where the package may walk the rows on them (xgrammar,
        # the pool, the switch): a guidance lane's walk stays serial.
        med["verify_threads"] = int(mode != "stock" and parallel_rows.wanted(
            lanes[mode].manager, ["a", "b"]))
        if t is not None and t.cost is not None:
            med["cost_row_factor"] = t.cost.row_factor
            # The cost model's state at the end of the run, and what it
            # expects a walk of the batch to cost (ms a step) on the step
            # as stock would take it (`step_ms`, at --gpu-step-ms).
            snap = {**t.cost.snapshot(),
                    "requests_per_step": t.cost.requests_per_step,
                    "rows": t.cost.batch_rows, "gpu_step_ms": args.gpu_step_ms}
            if t.cost.step_ns and t.cost.batch_rows \
                    and not t.cost.measuring(t.cost.batch_rows):
                _, rel = t.cost.expected(t.cost.batch_rows, k)
                snap["cost_ms"] = rel * t.cost.step_ns / 1e6
            med["cost_model"] = snap
        out["modes"][mode] = med
    if floor_steps:
        calls = {name: {"ms": ns / 1e6 / floor_steps,
                        "calls": _FLOOR["calls"][name] / floor_steps,
                        "items": _FLOOR["items"][name] / floor_steps}
                 for name, ns in _FLOOR["ns"].items()}
        out["floor"] = {
            "calls": calls, "steps": floor_steps,
            "library_ms": sum(c["ms"] for c in calls.values()),
            "draft_cpu_ms": out["modes"]["always"]["draft_cpu_ms"]
            if "always" in out["modes"] else float("nan")}
    return out


_COMPILE = {"ns": 0}


def _feed_step_times() -> None:
    """The cost model reads a step's length as the time since its last
    reading; here it is given the modelled GPU host's step (`bench_step_ns`,
    set per lane and repetition) at the moment it reads it, so the shadows'
    advance before the reading (and its one-off compiles) is not counted
    twice: the last drafting step's CPU work is in the step already."""
    from vllm_patch.v1.spec_decode import draft_cost as dc

    inner = dc.DraftCost.observe
    if getattr(inner, "_fed", False):
        return

    def observe(self: Any, *a: Any, **kw: Any) -> Any:
        step = getattr(self, "bench_step_ns", None)
        if step is not None and self.last_step_at is not None:
            self.last_step_at = time.perf_counter_ns() - step
        return inner(self, *a, **kw)

    observe._fed = True  # type: ignore[attr-defined]
    dc.DraftCost.observe = observe


def _time_compiles() -> None:
    """Shadow compiles are one-off: timed apart from the steady state."""
    from vllm_patch.v1.spec_decode import grammar_drafts as gd

    inner = gd._compile
    if getattr(inner, "_timed", False):
        return

    def _compile(*a: Any, **kw: Any) -> Any:
        t0 = time.thread_time_ns()
        try:
            return inner(*a, **kw)
        finally:
            _COMPILE["ns"] += time.thread_time_ns() - t0

    _compile._timed = True  # type: ignore[attr-defined]
    gd._compile = _compile


# ------------------------------------------------------------- projection

def row_factor(m: dict[str, Any], stock: dict[str, Any]) -> float:
    """What a verification row cost this lane's engine thread against a
    row of stock's serial walk: where the lane's scheduler had vLLM's fill
    pool, the measured wall time per row, the lane's over stock's (what
    the threaded walk really cost, the waits for the fill threads
    included; `verify_row_factor` is what the scheduler's own measurements
    claimed, which the drafting cost model reads); 1 for a serial lane
    (its rows are stock's work, priced at stock's cost per row)."""
    if not m.get("verify_threads") or not m.get("verify_rows") \
            or not stock.get("verify_rows") or not stock.get("verify_wall_ms"):
        return 1.0
    return (m["verify_wall_ms"] / m["verify_rows"]) \
        / (stock["verify_wall_ms"] / stock["verify_rows"])


def priced_grammar_ms(cell: dict[str, Any]) -> dict[str, float]:
    """Each mode's grammar CPU per step with its verification priced at
    stock's measured cost per bitmask row in the same cell, times the rows
    the mode's verification filled, plus the mode's own drafting CPU
    (measured in its hooks). Two lanes doing the same verification work
    time it up to about 10 % apart (the off lane's drafts are stock's, and
    it measured 0.90x-1.12x of stock): far more than the feature's own cost
    when it is off. Pricing the rows keeps what differs between the modes
    (how many rows, what the hooks cost) and drops the timing noise."""
    modes = cell["modes"]
    stock = modes["stock"]
    per_row = stock["verify_ms"] / max(stock.get("verify_rows", 0.0), 1.0)
    return {mode: (per_row * row_factor(m, stock) * m["verify_rows"]
                   if "verify_rows" in m else m["verify_ms"])
            + m.get("draft_cpu_ms", 0.0)
            for mode, m in modes.items()}


def modelled_grammar_ms(cell: dict[str, Any]) -> dict[str, float]:
    """As `priced_grammar_ms`, for the drafters the simulation does not
    run (EAGLE, draft model, perfect: their tokens per step come from the
    tiny world). The default mode's rows are interpolated as its tokens
    are: its share of rows that walked the grammar gets always-on's rows,
    the rest stock's (they drafted as stock did: the rows and tokens at
    the same document points are stock's; the simulated lane's own rows
    and tokens differ from stock's by where its requests are in their
    documents after the steps that walked, and the sim drafter's figures
    keep those). Plus the default's own drafting CPU, measured."""
    priced = priced_grammar_ms(cell)
    modes = cell["modes"]
    stock, always, default = (modes.get(m) for m in ("stock", "always", "default"))
    if default is not None and stock is not None and always is not None \
            and "verify_rows" in stock:
        share = default.get("on_share", 1.0)
        per_row = stock["verify_ms"] / max(stock["verify_rows"], 1.0)
        rows = stock["verify_rows"] + share * (always["verify_rows"]
                                               - stock["verify_rows"])
        priced["default"] = per_row * row_factor(default, stock) \
            * rows + default.get("draft_cpu_ms", 0.0)
    return priced


def default_decision(m: dict[str, Any], tps: dict[str, float],
                     gpu: float) -> str:
    """What the defaults' cost model decides for a drafter the benchmark
    does not run (EAGLE, draft model, perfect: their tokens per step come
    from the tiny world): its rule (walk iff the walked requests' speed-up
    over the batch's requests beats the walk's relative cost) with that
    drafter's speed-up and the cost the model measured in this cell, its
    margin included
    (walking every row, on the step as stock takes it, rescaled to `gpu`).
    "always" (it walks: always-on's work and tokens), "off" (the feature
    switched off, as after it goes dormant) or "mixed" where the model did
    not measure a cost (the simulated drafter's share of rows walked)."""
    cm = m.get("cost_model") or {}
    if "cost_ms" not in cm or not cm.get("step_ms"):
        return "mixed"
    speedup = tps["patched"] / tps["stock"] - 1.0
    gain = speedup * cm["rows"] / max(cm.get("requests_per_step") or 1.0, 1.0)
    cost = cm["cost_ms"] / (gpu + cm["step_ms"] - cm["gpu_step_ms"])
    from vllm_patch.v1.spec_decode.draft_cost import DECISION_MARGIN

    return "always" if gain > DECISION_MARGIN * cost else "off"


def project(cell: dict[str, Any], tokens: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Output tokens/s per mode and drafter on a GPU-host model: B x tokens
    per step / (GPU step + CPU grammar work on the engine thread), relative
    to stock. The drafters: the tiny world's end-to-end figures (`tokens`)
    and `sim`, this benchmark's own simulated drafter, the tokens per step
    each lane measured (the world the cost model decided in; in JSON only:
    lanes that drafted differently are at different points of their
    documents, so their tokens per step differ by more than the drafting:
    the cost model's own gain, counted against the same request's stock
    drafts, is the exact one). The grammar
    work: rows priced (`priced_grammar_ms`; for the tiny world's drafters
    the default's rows as `modelled_grammar_ms` says); `measured_20ms`
    keeps the raw timings at 20 ms."""
    out: dict[str, Any] = {}
    b = cell["batch"]
    modes = cell["modes"]
    priced = priced_grammar_ms(cell)
    modelled = modelled_grammar_ms(cell)
    measured = {mode: m["grammar_cpu_ms"] for mode, m in modes.items()}
    sim = {mode: m.get("tokens_per_step") for mode, m in modes.items()}

    def rel(gpu: float, grammar: dict[str, float]) -> dict[str, Any]:
        per: dict[str, Any] = {}
        for drafter, tps in {**tokens, "sim": None}.items():
            rates = {}
            for mode, m in modes.items():
                like = mode
                if drafter == "sim":
                    if sim.get(mode) is None:
                        continue
                    t = sim[mode]
                elif mode in ("stock", "off"):
                    t = tps["stock"]
                elif mode == "default":
                    like = default_decision(m, tps, gpu)
                    if like == "always":
                        t = tps["patched"]
                    elif like == "off":
                        t = tps["stock"]
                    else:
                        share = m.get("on_share", 1.0)
                        t = tps["stock"] + share * (tps["patched"]
                                                    - tps["stock"])
                        like = mode
                else:
                    t = tps["patched"]
                if like not in grammar:
                    like = mode
                work = grammar[like]
                if drafter != "sim" and grammar is priced:
                    work = modelled[like]
                rates[mode] = b * t / ((gpu + work) / 1e3)
            if rates:
                per[drafter] = {mode: round(r / rates["stock"], 3)
                                for mode, r in rates.items()} \
                    if "stock" in rates else rates
        return per

    for gpu in GPU_STEPS_MS:
        out[f"{gpu:g}ms"] = rel(gpu, priced)
    out["measured_20ms"] = rel(20.0, measured)
    # The verification's wall time (the engine thread waits for its fill
    # threads) plus the drafting CPU: what --verify-threads is read with.
    out["wall_20ms"] = rel(20.0, {
        mode: m.get("verify_wall_ms", m["verify_ms"]) + m.get("draft_cpu_ms", 0.0)
        for mode, m in modes.items()})
    return out


# ------------------------------------------------------------------ output

def table(cells: list[dict[str, Any]]) -> str:
    head = ("| vocab | backend | k | B | verify rows: stock / always | "
            "verify ms: stock / always | drafting CPU ms: always | "
            "default (on share) | total grammar CPU, all threads: always vs stock | "
            "h2d KB always | syncs | projected tok/s vs stock @20 ms, EAGLE: "
            "always / default | perfect: always / default | "
            "EAGLE from wall times: always / default | "
            "row price vs stock's, default: measured / the scheduler's |")
    lines = [head, "|" + "---|" * 15]
    for c in cells:
        m = c["modes"]
        s, a, d = m["stock"], m["always"], m["default"]
        p = c["projection"]["20ms"]
        rows = (f"{s['verify_rows']:.0f} / {a['verify_rows']:.0f}"
                if "verify_rows" in s else "-")
        lines.append(
            f"| {c['vocab']} | {c['backend']} | {c['k']} | {c['batch']} | {rows} | "
            f"{s['verify_ms']:.2f} / {a['verify_ms']:.2f} | {a['draft_cpu_ms']:.2f} | "
            f"{d['draft_cpu_ms']:.2f} ({d.get('on_share', 0):.0%}) | "
            f"{a['grammar_cpu_ms']:.2f} vs {s['grammar_cpu_ms']:.2f} | "
            f"{a['h2d_bytes'] / 1e3:.1f} | {a['d2h_syncs']:.0f} | "
            f"{p['eagle']['always']:.2f}x / {p['eagle']['default']:.2f}x | "
            f"{p['perfect']['always']:.2f}x / {p['perfect']['default']:.2f}x | "
            + (f"{w['eagle']['always']:.2f}x / {w['eagle']['default']:.2f}x |"
               if (w := c["projection"].get("wall_20ms")) else "- |")
            + f" {row_factor(d, s):.2f} / {d.get('verify_row_factor', 1.0):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        cells = [c for p in args.render for c in json.loads(Path(p).read_text())["cells"]]
        print(table(cells))
        return 0
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    for f in FLAGS:
        os.environ.pop(f, None)
    os.environ.pop("VLLM_PATCH_DISABLE", None)
    import torch

    import vllm_patch

    # One core: the engine thread's work, not torch's intra-op threads.
    torch.set_num_threads(1)
    vllm_patch.register()
    _time_compiles()
    _feed_step_times()
    tokens = DEFAULT_TOKENS
    if args.tokens_from:
        tokens = json.loads(Path(args.tokens_from).read_text())
    vocabs = [v for v in args.vocabs.split(",") if v]
    backends = [b for b in args.backends.split(",") if b]
    ks = [int(x) for x in args.k.split(",")]
    batches = [int(x) for x in args.batch.split(",")]
    cells: list[dict[str, Any]] = []
    skipped: list[str] = []
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
    t_start = time.perf_counter()
    for vocab in vocabs:
        for kind in backends:
            try:
                world = World(vocab, kind, args)
            except Exception as exc:  # noqa: BLE001 - a pair the backend refuses
                skipped.append(f"{vocab}/{kind}: {exc}")
                log(f"skip {vocab} {kind}: {exc}")
                continue
            log(f"{vocab} ({world.size} tokens) {kind}: {len(world.docs)} documents")
            for k in ks:
                for b in batches:
                    t0 = time.perf_counter()
                    cell = run_cell(world, k, b, args, profile=profile)
                    cell["projection"] = project(cell, tokens)
                    cell["wall_s"] = round(time.perf_counter() - t0, 1)
                    cells.append(cell)
                    m = cell["modes"]
                    log(f"  k={k} B={b}: stock verify {m['stock']['verify_ms']:.2f} ms, "
                        f"drafting CPU always {m['always']['draft_cpu_ms']:.2f} ms, "
                        f"default {m['default']['draft_cpu_ms']:.2f} ms "
                        f"(on {m['default'].get('on_share', 0):.0%}) "
                        f"[{cell['wall_s']} s]")
    result = {
        "what": "thread CPU time per engine step, medians over interleaved "
                "repetitions; projection = a GPU-host cost model, not a GPU "
                "measurement",
        "vllm": __import__("vllm").__version__,
        "args": vars(args), "tokens_per_step": tokens,
        "skipped": skipped, "cells": cells,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print(table(cells))
    print("\nProjected tokens/s: a model of a GPU host (GPU step + the CPU grammar "
          "work on the serial engine thread), not a GPU measurement. Tokens per "
          f"step from: {args.tokens_from or 'the tiny world README figures'}.")
    for s in skipped:
        print(f"skipped: {s}")
    for cell in cells:
        if cell.get("floor"):
            print("\n" + floor_table(cell))
    if profile is not None:
        import io
        import pstats

        buf = io.StringIO()
        st = pstats.Stats(profile, stream=buf).sort_stats("tottime")
        st.print_stats(25)
        print(buf.getvalue())
        result["profile_top"] = buf.getvalue()
        if args.json:
            profile.dump_stats(args.json + ".prof")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
