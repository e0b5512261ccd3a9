"""Property-based fuzzing of grammar x speculative decoding x scheduling.

One *episode*: a real `Scheduler` / `AsyncScheduler` (the harness, driven
through its EngineCore loop emulation `engine_setup`/`engine_step`, batch
queue depth 1-3), 2-8 requests (structured from a grammar family or not;
ignore_eos, max_tokens, min_tokens, stop tokens, logprobs, staggered
arrival, aborts), a small KV pool (preemption), a simulated model that
samples from the bitmask rows (sometimes ignoring them), drafts and random
acceptance. The invariant checker (`vllm_patch.v1.core.sched.invariants`)
runs after every `update_from_output` in "record" mode; an exception that
escapes the engine loop is the property `exception`.

Two draft sources (`EpisodeSpec.drafts`):
- "random": the simulated drafter proposes its target completion, filler
  tokens, cut short at random (any token, in or out of the grammar);
- "grammar": grammar-aware drafting's own code
  (`vllm_patch.v1.spec_decode.grammar_drafts`: a shadow grammar per
  structured request compiled by the scheduler's backend, advanced by the
  sampled tokens through xgrammar's batched matcher calls, walked per draft
  position: masked drafts, forced tokens, the grammar's forced continuation
  as the first drafts, drafts trimmed after the grammar's end) turns the
  simulated drafter's logits (a preferred token: its target completion or
  filler, plus noise) into the drafts the scheduler sees, as V1's EAGLE /
  draft-model drafters do (`GrammarDrafter`). The cost model is off (every
  step walks, as VLLM_PATCH_DRAFT_COST_MODEL=0). Its episodes also draw
  real schemas from JSONSchemaBench (MaskBench entries: a schema and a
  valid instance the model aims at), compact JSON or not. The same code
  runs in the stock run (VLLM_PATCH_DISABLE=1 only leaves vLLM's scheduler
  stock): stock's violations are the scheduler's under these drafts.

`episodes()` is the hypothesis strategy (`episodes("grammar")` for the
grammar-aware draft source); `run_episode(spec)` returns the violations. Used by tests/v1/core/test_fuzz.py and
benchmarks/fuzz_campaign.py.
"""

from __future__ import annotations

import random
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from vllm_patch.testing.harness import (END_THINK, EOS, IM_END, THINK, Harness,
                                        bare_eagle_proposer)
from vllm_patch.v1.core.sched.scheduler import invariants as inv

# not_drained: after every request was aborted and the engine ran on, the
# scheduler still holds a request, a transfer, or connector bookkeeping.
PROPERTIES = inv.INVARIANTS + ("exception", "not_drained")

# (kind, spec, sample completions). Kinds: regex, choice, json, grammar.
GRAMMARS: list[tuple[str, Any, list[str]]] = [
    ("regex", "(ab|cd)e", ["abe", "cde"]),
    ("regex", "a[0-9]{1,3}b", ["a1b", "a123b"]),
    ("regex", "(yes|no)!?", ["yes", "no!"]),
    ("choice", ["red", "green", "blue"], ["red", "blue"]),
    ("choice", ["x", "xy"], ["x", "xy"]),
    ("json", {"type": "object", "properties": {"a": {"type": "integer"}},
              "required": ["a"], "additionalProperties": False},
     ['{"a": 12}', '{"a":3}']),
    ("json", {"type": "boolean"}, ["true", "false"]),
    ("json", {"enum": ["on", "off"]}, ['"on"', '"off"']),
    ("grammar", 'root ::= "a" ("b" | "cd") | "e" "f"*', ["ab", "acd", "eff"]),
    ("grammar", 'root ::= ("x" | "y") ("x" | "y")? "z"', ["xz", "yxz"]),
]
# Outlines supports no grammar (EBNF) specs.
_BACKEND_KINDS = {
    "xgrammar": ("regex", "choice", "json", "grammar"),
    "guidance": ("regex", "choice", "json", "grammar"),
    "outlines": ("regex", "choice", "json"),
}
BACKENDS = tuple(_BACKEND_KINDS)
PROMPTS = ["xy", "xyxy", "hello", "ab cd", "xyxyxyxyxy",
           "1 2 3 4 5 6 7 8 9 0 1 2"]
FILLER = ["a", "b", "c", "d", "e", "x", "y", "z", "1", "!", " "]


@dataclass
class RequestSpec:
    grammar: int | None        # index in GRAMMARS, None: unstructured
    completion: int            # which sample completion the model aims at
    prompt: int
    ignore_eos: bool
    max_tokens: int
    min_tokens: int
    stop: bool                 # stop_token_ids=[IM_END + "z"]
    logprobs: int | None
    arrive: int                # engine step at which it is added
    abort_at: int | None       # engine step at which it is aborted
    # KV connector (EpisodeSpec.kv set): 0 local prefill; 1 decode
    # instance, KV pulled from a remote prefill (do_remote_prefill); 2
    # prefill instance (do_remote_decode: blocks pinned after the finish
    # until the simulated worker reports them sent).
    remote: int = 0
    kv_delay: int = 0          # steps until the transfer is reported
    kv_fail: str | None = None  # KVWorkerSim failure: blocks/request/nixl
    kv_fail_block: int = 0     # which block fails ("blocks")
    # The grammar compile finishes hold_grammar engine steps after arrival
    # (None: ready when added); grammar_error: the compile fails.
    hold_grammar: int | None = None
    grammar_error: bool = False
    # Reasoning episodes (EpisodeSpec.reasoning): the model aims at `think`
    # reasoning tokens, then </think>, then the grammar's completion; 3:
    # the prompt already ends the reasoning (<think></think>).
    think: int = 0
    # A JSONSchemaBench schema (index in jsb_grammars()) instead of
    # GRAMMARS[grammar] (grammar is then 0: structured).
    jsb: int | None = None


@dataclass
class EpisodeSpec:
    backend: str
    async_scheduling: bool
    depth: int
    num_spec_tokens: int
    num_blocks: int
    requests: list[RequestSpec]
    p_bad: float               # model ignores the mask
    p_accept: float            # an allowed draft is accepted
    p_follow: float            # model follows its target completion
    seed: int
    # KV connector: None, or NixlConnector (scheduler side, kv_both) with
    # this kv_load_failure_policy ("fail" / "recompute"); worker simulated.
    kv: str | None = None
    # vLLM's deepseek_r1 reasoning parser on the tiny tokenizer's
    # <think>/</think>: the grammar starts after the reasoning end.
    reasoning: bool = False
    # Draft source: "random" or "grammar" (module docstring).
    drafts: str = "random"
    # Compact JSON (structured_outputs_config.disable_any_whitespace).
    compact: bool = False


@dataclass
class Result:
    violations: list[inv.Violation] = field(default_factory=list)
    steps: int = 0
    finished: int = 0
    # The grammar-aware draft source's counters (grammar_drafts' stats).
    draft_stats: dict[str, int] = field(default_factory=dict)

    def properties(self) -> set[str]:
        return {v.invariant for v in self.violations}


# JSONSchemaBench (MaskBench) schemas with a valid instance of at most this
# many characters (compact), that xgrammar and guidance both take.
JSB_COUNT = 8
JSB_MAX_CHARS = 60
_JSB: list[tuple[str, Any, list[str]]] | None = None


def jsb_grammars() -> list[tuple[str, Any, list[str]]]:
    """Real schemas for the grammar-aware draft source: the first
    JSB_COUNT MaskBench entries (sorted file names) with a short valid
    instance whose schema both backends compile; [] when the sample is
    missing (vllm_patch.testing.jsonschemabench)."""
    global _JSB
    if _JSB is not None:
        return _JSB
    import glob
    import json
    import os

    from vllm_patch.testing.engine import _validate_schema
    from vllm_patch.testing.jsonschemabench import MASKBENCH

    out: list[tuple[str, Any, list[str]]] = []
    for f in sorted(glob.glob(os.path.join(str(MASKBENCH), "*.json"))):
        with open(f) as fh:
            entry = json.load(fh)
        schema = entry.get("schema")
        docs = [json.dumps(t["data"], separators=(",", ":"))
                for t in entry.get("tests", []) if t.get("valid")]
        docs = [d for d in docs if len(d) <= JSB_MAX_CHARS]
        if not isinstance(schema, dict) or not docs:
            continue
        try:
            from vllm.v1.structured_output.backend_xgrammar import (
                has_xgrammar_unsupported_json_features)

            if has_xgrammar_unsupported_json_features(schema):
                continue
            _validate_schema("xgrammar", schema)
            _validate_schema("guidance", schema)
        except Exception:  # noqa: BLE001 - a backend rejects this schema
            continue
        out.append(("json", schema, docs[:2]))
        if len(out) == JSB_COUNT:
            break
    _JSB = out
    return out


def _grammar(rs: RequestSpec) -> tuple[str, Any, list[str]]:
    if rs.jsb is not None:
        return jsb_grammars()[rs.jsb]
    return GRAMMARS[rs.grammar]


def episodes(drafts: str = "random") -> Any:
    """Episodes with the `drafts` source ("random" or "grammar")."""
    from hypothesis import strategies as st

    grammar_drafts = drafts == "grammar"
    jsb = len(jsb_grammars()) if grammar_drafts else 0

    @st.composite
    def request(draw: Any, backend: str, kv: str | None,
                reasoning: bool) -> RequestSpec:
        kinds = _BACKEND_KINDS[backend]
        choices = [i for i, g in enumerate(GRAMMARS) if g[0] in kinds]
        g = draw(st.one_of(st.none(), st.sampled_from(choices),
                           st.sampled_from(choices)))
        j = None
        if jsb and backend != "outlines" and g is not None \
                and draw(st.booleans()):
            j = draw(st.integers(0, jsb - 1))
        remote = draw(st.sampled_from([0, 1, 1, 1, 2])) if kv else 0
        hold = None
        if g is not None:
            hold = draw(st.one_of(st.none(), st.none(), st.integers(0, 4)))
        return RequestSpec(
            grammar=g,
            completion=draw(st.integers(0, 1)),
            prompt=draw(st.integers(0, len(PROMPTS) - 1)),
            ignore_eos=draw(st.booleans()),
            max_tokens=draw(st.integers(1, 48 if j is not None else 16)),
            min_tokens=draw(st.sampled_from([0, 0, 1, 3])),
            stop=draw(st.booleans()),
            logprobs=draw(st.sampled_from([None, None, 0, 1])),
            arrive=draw(st.sampled_from([0, 0, 0, 1, 3])),
            abort_at=draw(st.one_of(st.none(), st.none(), st.none(),
                                    st.integers(1, 10))),
            remote=remote,
            kv_delay=draw(st.integers(0, 4)) if remote else 0,
            kv_fail=draw(st.sampled_from([None, None, "blocks", "request",
                                          "nixl"])) if remote == 1 else None,
            kv_fail_block=draw(st.integers(0, 3)) if remote == 1 else 0,
            hold_grammar=hold,
            grammar_error=draw(st.sampled_from([False] * 7 + [True]))
            if hold is not None else False,
            think=draw(st.integers(0, 3)) if reasoning else 0,
            jsb=j,
        )

    @st.composite
    def episode(draw: Any) -> EpisodeSpec:
        # Grammar-aware drafts: xgrammar (the batched path) half the time.
        backend = draw(st.sampled_from(
            ("xgrammar", "guidance", "xgrammar", "outlines")
            if grammar_drafts else BACKENDS))
        compact = grammar_drafts and backend != "outlines" and \
            draw(st.sampled_from([True, False]))
        async_ = draw(st.booleans())
        depth = draw(st.integers(2, 3)) if async_ else \
            draw(st.sampled_from([1, 1, 2]))
        kv = draw(st.sampled_from([None, None, None, "fail", "recompute"]))
        # Grammar-aware drafting is off with a reasoning parser.
        reasoning = False if grammar_drafts else \
            draw(st.sampled_from([False, False, False, True]))
        return EpisodeSpec(
            backend=backend,
            async_scheduling=async_,
            depth=depth,
            num_spec_tokens=draw(st.integers(1, 4) if grammar_drafts
                                 else st.integers(0, 3)),
            num_blocks=draw(st.integers(12, 40)),
            requests=draw(st.lists(request(backend, kv, reasoning),
                                   min_size=3 if grammar_drafts else 2,
                                   max_size=8)),
            p_bad=draw(st.sampled_from([0.0, 0.0, 0.05, 0.3])),
            p_accept=draw(st.sampled_from([0.3, 0.7, 0.95])),
            p_follow=draw(st.sampled_from([0.5, 0.9])),
            seed=draw(st.integers(0, 2**16)),
            kv=kv,
            reasoning=reasoning,
            drafts=drafts,
            compact=compact,
        )

    return episode()


class _Model:
    """The simulated worker: sampler and drafter for `engine_setup`."""

    def __init__(self, h: Harness, spec: EpisodeSpec,
                 targets: dict[str, RequestSpec]) -> None:
        self.h = h
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.vocab = len(h.tokenizer)
        self.filler = [h.encode(s)[0] for s in FILLER] + [EOS, IM_END]
        if spec.reasoning:
            self.filler.append(END_THINK)
        self.z = h.tok("z")
        self.targets: dict[str, list[int]] = {}
        self.req: dict[str, RequestSpec] = targets
        for rid, rs in targets.items():
            think: list[int] = []
            if rs.grammar is None:
                text = "xyzab"
            else:
                comps = _grammar(rs)[2]
                text = comps[rs.completion % len(comps)]
                if spec.reasoning and rs.think < 3:
                    think = h.encode("hmm ok")[: rs.think] + [END_THINK]
            self.targets[rid] = think + h.encode(text) + [EOS]
        self._rows: dict[bytes, np.ndarray] = {}

    def allowed(self, row: np.ndarray | None) -> np.ndarray | None:
        if row is None:
            return None
        key = row.tobytes()
        a = self._rows.get(key)
        if a is None:
            bits = np.unpackbits(row.view(np.uint8), bitorder="little")
            a = np.flatnonzero(bits[: self.vocab])
            self._rows[key] = a
        return a

    def _stops(self, rid: str) -> set[int]:
        rs = self.req[rid]
        s = {EOS, IM_END}
        if rs.stop:
            s.add(self.z)
        return s

    def pick(self, rid: str, allowed: np.ndarray | None,
             ctx: list[int]) -> int:
        rng = self.rng
        if rng.random() < self.spec.p_bad:
            return rng.choice(self.filler)
        target = self.targets[rid]
        n = len(ctx)
        want = target[n] if n < len(target) and ctx == target[:n] else None
        rs = self.req[rid]
        stops = self._stops(rid)
        if allowed is None:
            cands = self.filler
        else:
            cands = [int(t) for t in allowed]
        if n < rs.min_tokens:
            # min_tokens logits processor masks EOS / stop tokens.
            c2 = [t for t in cands if t not in stops]
            cands = c2 or cands
            if want in stops:
                want = None
        if want is not None and (allowed is None or want in cands) and \
                rng.random() < self.spec.p_follow:
            return want
        if not cands:
            return EOS
        return rng.choice(cands)

    def sampler(self, h: Harness, rid: str, ctx: list[int], rows: Any,
                spec: list[int]) -> list[int]:
        out: list[int] = []
        rng = self.rng
        if any(d < 0 for d in spec):
            # Async placeholders: the worker verifies its own drafts.
            own = self.own_drafts(h, rid, ctx) if spec else []
            spec = (own + [EOS] * len(spec))[: len(spec)]
        for i in range(len(spec) + 1):
            row = rows[i] if rows is not None and i < len(rows) else None
            allowed = self.allowed(row)
            if i < len(spec):
                d = spec[i]
                ok = allowed is None or d in allowed
                if ok and rng.random() < self.spec.p_accept:
                    out.append(d)
                    continue
                if not ok and rng.random() < self.spec.p_bad:
                    out.append(d)  # runner accepted a masked draft
                    continue
            out.append(self.pick(rid, allowed, ctx + out))
            break
        return out

    def drafter(self, h: Harness, rid: str, ctx: list[int]) -> list[int]:
        k = self.spec.num_spec_tokens
        rng = self.rng
        r = rng.random()
        if r < 0.15:
            return []
        target = self.targets.get(rid, [])
        n = len(ctx)
        if r < 0.7 and ctx == target[:n]:
            d = list(target[n:n + k])
        else:
            d = []
        while len(d) < k:
            d.append(rng.choice(self.filler))
        if rng.random() < 0.2 and d:
            d[rng.randrange(len(d))] = rng.choice(self.filler)
        return d[: rng.randint(1, k)] if rng.random() < 0.3 else d

    # The draft source ("grammar": set by run_episode).
    grammar_drafter: "GrammarDrafter | None" = None

    def own_drafts(self, h: Harness, rid: str, ctx: list[int]) -> list[int]:
        """The worker's own drafts for a step scheduled with placeholders
        (async scheduling)."""
        if self.grammar_drafter is not None:
            return self.grammar_drafter.placeholder(h, rid, ctx)
        return self.drafter(h, rid, ctx)

    def preferred(self, rid: str, ctx: list[int]) -> tuple[int, int | None]:
        """The simulated drafter model's choice after `ctx` (its target
        completion while on it, else filler) and, now and then, a runner-up
        (the target's token when the choice is not it)."""
        rng = self.rng
        target = self.targets.get(rid, [])
        n = len(ctx)
        want = target[n] if n < len(target) and ctx == target[:n] else None
        if want is not None and rng.random() < 0.6:
            return want, None
        other = rng.choice(self.filler)
        return other, want if rng.random() < 0.5 else None


class GrammarDrafter:
    """The "grammar" draft source: V1's grammar-aware drafting
    (grammar_drafts.advance / begin / sample per position / end /
    take_limits / trim_drafts, as the patched EAGLE / draft-model proposer
    calls them) on a drafter whose model's logits are simulated (`_Model.
    preferred`, plus noise). Shadows are compiled by the scheduler's own
    backend (the in-process executor's layout). A request whose worker
    context no longer extends what its shadow saw (preemption, recompute)
    gets a new shadow from its context."""

    def __init__(self, h: Harness, model: _Model, k: int) -> None:
        import weakref

        import torch

        from vllm_patch.v1.spec_decode import grammar_drafts as gd

        self.gd = gd
        self.model = model
        self.k = k
        d = bare_eagle_proposer(h.vllm_config,
                                SimpleNamespace(compute_logits=lambda hs: hs.clone()), k)
        self.drafter = d
        self.vocab = int(h.vllm_config.model_config.get_vocab_size())
        self.torch = torch
        self.gen = torch.Generator().manual_seed(model.spec.seed)
        self.t = gd.tracker(d)
        if self.t is not None:
            # Every step walks (the cost model measures time: not
            # reproducible); the forced continuation is always drafted.
            self.t.cost.enabled = False
            if self.t.forced_choice is not None:
                self.t.forced_choice.enabled = False
            self.t.manager_ref = weakref.ref(h.structured_output_manager)
        # req_id -> the worker context its shadow has taken.
        self.seen: dict[str, list[int]] = {}
        self._placeholders: tuple[int, dict[str, list[int]]] = (-1, {})

    def __call__(self, h: Harness, rid: str, ctx: list[int]) -> list[int]:
        return self.batch(h, [rid], {rid: ctx})[rid]

    def placeholder(self, h: Harness, rid: str, ctx: list[int]) -> list[int]:
        """Drafts for a row of the step being sampled: the batch of that
        step's rows with placeholder drafts, proposed once."""
        so = getattr(h, "sampling", None)
        if so is None:
            return self(h, rid, ctx)
        key, got = self._placeholders
        if key != id(so):
            rec = so._vllm_patch_record
            rids = [r for r in so._vllm_patch_samples
                    if any(x < 0 for x in
                           so.scheduled_spec_decode_tokens.get(r, ()))]
            got = self.batch(h, rids, {r: rec.ctx[r] for r in rids})
            self._placeholders = (id(so), got)
        return got[rid] if rid in got else self(h, rid, ctx)

    def batch(self, h: Harness, rids: list[str],
              ctxs: dict[str, list[int]]) -> dict[str, list[int]]:
        """The drafts of one propose over the batch `rids`."""
        torch, gd, t = self.torch, self.gd, self.t
        d = self.drafter
        if not rids:
            return {}
        live = {r: q for r, q in h.scheduler.requests.items()}
        for r in [r for r in self.seen if r not in live]:
            del self.seen[r]
        if t is not None:
            sampled: list[list[int]] = []
            for r in rids:
                ctx, seen = ctxs[r], self.seen.get(r)
                if seen is not None and ctx[:len(seen)] == seen:
                    sampled.append(ctx[len(seen):])
                    continue
                # First sight, or the context moved under the shadow: a
                # new shadow caught up with the whole context.
                t.shadows.pop(r, None)
                t.lost.discard(r)
                sampled.append(list(ctx))
            requests = {r: SimpleNamespace(
                sampling_params=q.sampling_params,
                output_token_ids=list(ctxs.get(r, self.seen.get(r, []))))
                for r, q in live.items()}
            gd.advance(d, requests, rids, sampled,
                       [not x for x in sampled], outputs_include_step=True)
            for r in rids:
                self.seen[r] = list(ctxs[r])
            gd.begin(d, len(rids))
        drafts: list[list[int]] = [[] for _ in rids]
        meta = SimpleNamespace(all_greedy=True)

        def original(_d: Any, hs: Any, _m: Any) -> Any:
            return hs.argmax(dim=-1), None

        try:
            for _ in range(self.k):
                logits = torch.randn(len(rids), self.vocab,
                                     generator=self.gen)
                for i, r in enumerate(rids):
                    best, second = self.model.preferred(r, ctxs[r] + drafts[i])
                    logits[i, best] += 12.0
                    if second is not None and second != best:
                        logits[i, second] += 6.0
                if t is not None:
                    ids, _ = gd.sample(d, original, logits, meta)
                else:
                    ids, _ = original(d, logits, meta)
                for i, x in enumerate(ids.tolist()):
                    drafts[i].append(int(x))
        finally:
            if t is not None:
                gd.end(d)
        out = SimpleNamespace(req_ids=list(rids), draft_token_ids=drafts)
        if t is not None:
            out = gd.trim_drafts(out, gd.take_limits(d), t.stats)
        return dict(zip(rids, (list(x) for x in out.draft_token_ids)))

    def stats(self) -> dict[str, int]:
        if self.t is None:
            return {}
        return {k: v for k, v in self.t.stats.items() if isinstance(v, int)}


class FuzzHarness(Harness):
    """The harness's engine loop, with sampled-token logprob rows in the
    runner output."""

    engine_logprobs = True


def kv_transfer_config(policy: str) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both",
                            kv_load_failure_policy=policy)


def run_episode(spec: EpisodeSpec, raise_exceptions: bool = False) -> Result:
    from vllm.v1.request import RequestStatus

    from vllm_patch.testing.harness import KVWorkerSim

    res = Result()
    h = FuzzHarness(spec.backend, async_scheduling=spec.async_scheduling,
                disable_any_whitespace=spec.compact,
                num_spec_tokens=spec.num_spec_tokens, block_size=4,
                num_blocks=spec.num_blocks, max_num_seqs=8,
                max_num_batched_tokens=64,
                kv_transfer_config=kv_transfer_config(spec.kv)
                if spec.kv else None,
                reasoning_parser="deepseek_r1" if spec.reasoning else None)
    sched = h.scheduler
    chk = inv.instrument(sched)
    inv.set_mode(sched, "record", res.violations.append)
    rids: dict[str, RequestSpec] = {f"q{i}": rs
                                    for i, rs in enumerate(spec.requests)}
    model = _Model(h, spec, rids)
    drafter: Any = model.drafter if spec.num_spec_tokens else None
    if spec.drafts == "grammar" and spec.num_spec_tokens:
        drafter = model.grammar_drafter = GrammarDrafter(
            h, model, spec.num_spec_tokens)
    h.engine_setup(spec.depth, sampler=model.sampler, drafter=drafter)
    if spec.kv:
        def plan(rid: str, kind: str) -> tuple[int, str | None]:
            rs = rids.get(rid)
            if rs is None:
                return 0, None
            return rs.kv_delay, (rs.kv_fail if kind == "recv" else None)

        h.kv_worker = KVWorkerSim(
            plan, lambda rid, n: rids[rid].kv_fail_block if rid in rids else 0)
    added: set[str] = set()
    held: dict[str, int] = {}

    def release(rid: str) -> None:
        h.release_grammar(rid, error=rids[rid].grammar_error)
        held.pop(rid, None)

    try:
        for step in range(120):
            for rid, rs in rids.items():
                if rid not in added and rs.arrive <= step:
                    _add(h, rid, rs)
                    added.add(rid)
                    if rs.hold_grammar is not None and rs.grammar is not None:
                        held[rid] = step + rs.hold_grammar
                elif rid in added and rs.abort_at == step and \
                        not h.request(rid).is_finished():
                    sched.finish_requests([rid],
                                          RequestStatus.FINISHED_ABORTED)
            for rid, at in list(held.items()):
                if at <= step:
                    release(rid)
            h.engine_step()
            res.steps += 1
            if len(added) == len(rids) and not held and \
                    not sched.has_requests() and not h.batch_queue:
                break
        for rid in list(held):
            release(rid)
        live = [r for r in added if not h.request(r).is_finished()]
        if live:
            sched.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        for _ in range(30):
            if not h.batch_queue and not sched.has_requests() and \
                    not (h.kv_worker and h.kv_worker.busy()):
                break
            h.engine_step()
        left = _leftovers(h)
        if left:
            res.violations.append(inv.Violation(
                "not_drained", None, f"after the drain: {left}", left))
        chk.check_idle()
    except Exception as exc:  # noqa: BLE001
        if raise_exceptions:
            raise
        res.violations.append(inv.Violation(
            "exception", None, f"{type(exc).__name__}: {exc}",
            {"traceback": traceback.format_exc(limit=8)}))
    res.finished = sum(1 for r in added if h.request(r).is_finished())
    if model.grammar_drafter is not None:
        res.draft_stats = model.grammar_drafter.stats()
    return res


def _leftovers(h: Harness) -> dict[str, Any]:
    sched = h.scheduler
    left: dict[str, Any] = {}
    if sched.requests:
        left["requests"] = {r: q.status.name for r, q in sched.requests.items()}
    if h.batch_queue:
        left["batch_queue"] = len(h.batch_queue)
    if h.kv_worker is not None and h.kv_worker.busy():
        left["transfers"] = [(k, r) for _, k, r, _, _ in h.kv_worker.pending]
    for name in ("finished_recving_kv_req_ids", "failed_recving_kv_req_ids"):
        ids = getattr(sched, name, None)
        if ids:
            left[name] = sorted(ids)
    return left


def _kv_params(h: Harness, rid: str, rs: RequestSpec,
               prompt: list[int]) -> dict[str, Any] | None:
    if rs.remote == 1:
        return dict(do_remote_prefill=True, do_remote_decode=False,
                    remote_engine_id="prefill-engine",
                    remote_request_id=f"p-{rid}",
                    remote_block_ids=list(range(
                        (len(prompt) + h.block_size - 1) // h.block_size)),
                    remote_host="127.0.0.1", remote_port=1234, tp_size=1)
    if rs.remote == 2:
        return dict(do_remote_decode=True, do_remote_prefill=False)
    return None


def _add(h: Harness, rid: str, rs: RequestSpec) -> None:
    kw: dict[str, Any] = {}
    if rs.grammar is not None:
        kind, g, _ = _grammar(rs)
        kw[kind] = g
        kw["hold_grammar"] = rs.hold_grammar is not None
    prompt = h.encode(PROMPTS[rs.prompt % len(PROMPTS)])
    if rs.think == 3 and rs.grammar is not None and \
            h.vllm_config.structured_outputs_config.reasoning_parser:
        prompt = prompt + [THINK, END_THINK]
    if h.kv_worker is not None:
        kw["kv_transfer_params"] = _kv_params(h, rid, rs, prompt)
    h.add_request(prompt, request_id=rid,
                  ignore_eos=rs.ignore_eos, max_tokens=rs.max_tokens,
                  min_tokens=min(rs.min_tokens, rs.max_tokens), logprobs=rs.logprobs,
                  stop_token_ids=[h.tok("z")] if rs.stop else None, **kw)


def describe(spec: EpisodeSpec) -> str:
    return repr(spec)
