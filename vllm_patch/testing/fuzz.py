"""Property-based fuzzing of grammar x speculative decoding x scheduling.

One *episode*: a real `Scheduler` / `AsyncScheduler` (the harness, driven
through its EngineCore loop emulation `engine_setup`/`engine_step`, batch
queue depth 1-3), 2-8 requests (structured from a grammar family or not;
ignore_eos, max_tokens, min_tokens, stop tokens, logprobs, staggered
arrival, aborts), a small KV pool (preemption), a simulated model that
samples from the bitmask rows (sometimes ignoring them), random drafts and
acceptance. The invariant checker (`vllm_patch.v1.core.sched.invariants`)
runs after every `update_from_output` in "record" mode; an exception that
escapes the engine loop is the property `exception`.

`episodes()` is the hypothesis strategy; `run_episode(spec)` returns the
violations. Used by tests/v1/core/test_fuzz.py and
benchmarks/fuzz_campaign.py.
"""

from __future__ import annotations

import random
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_patch.testing.harness import EOS, IM_END, Harness
from vllm_patch.v1.core.sched import invariants as inv

PROPERTIES = inv.INVARIANTS + ("exception",)

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
PROMPTS = ["xy", "xyxy", "hello", "ab cd", "xyxyxyxyxy"]
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


@dataclass
class Result:
    violations: list[inv.Violation] = field(default_factory=list)
    steps: int = 0
    finished: int = 0

    def properties(self) -> set[str]:
        return {v.invariant for v in self.violations}


def episodes() -> Any:
    from hypothesis import strategies as st

    @st.composite
    def request(draw: Any, backend: str) -> RequestSpec:
        kinds = _BACKEND_KINDS[backend]
        choices = [i for i, g in enumerate(GRAMMARS) if g[0] in kinds]
        g = draw(st.one_of(st.none(), st.sampled_from(choices),
                           st.sampled_from(choices)))
        return RequestSpec(
            grammar=g,
            completion=draw(st.integers(0, 1)),
            prompt=draw(st.integers(0, len(PROMPTS) - 1)),
            ignore_eos=draw(st.booleans()),
            max_tokens=draw(st.integers(1, 16)),
            min_tokens=draw(st.sampled_from([0, 0, 1, 3])),
            stop=draw(st.booleans()),
            logprobs=draw(st.sampled_from([None, None, 0, 1])),
            arrive=draw(st.sampled_from([0, 0, 0, 1, 3])),
            abort_at=draw(st.one_of(st.none(), st.none(), st.none(),
                                    st.integers(1, 10))),
        )

    @st.composite
    def episode(draw: Any) -> EpisodeSpec:
        backend = draw(st.sampled_from(BACKENDS))
        async_ = draw(st.booleans())
        depth = draw(st.integers(2, 3)) if async_ else \
            draw(st.sampled_from([1, 1, 2]))
        return EpisodeSpec(
            backend=backend,
            async_scheduling=async_,
            depth=depth,
            num_spec_tokens=draw(st.integers(0, 3)),
            num_blocks=draw(st.integers(12, 40)),
            requests=draw(st.lists(request(backend), min_size=2, max_size=8)),
            p_bad=draw(st.sampled_from([0.0, 0.0, 0.05, 0.3])),
            p_accept=draw(st.sampled_from([0.3, 0.7, 0.95])),
            p_follow=draw(st.sampled_from([0.5, 0.9])),
            seed=draw(st.integers(0, 2**16)),
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
        self.z = h.tok("z")
        self.targets: dict[str, list[int]] = {}
        self.req: dict[str, RequestSpec] = targets
        for rid, rs in targets.items():
            if rs.grammar is None:
                text = "xyzab"
            else:
                comps = GRAMMARS[rs.grammar][2]
                text = comps[rs.completion % len(comps)]
            self.targets[rid] = h.encode(text) + [EOS]
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
            own = self.drafter(h, rid, ctx) if spec else []
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


class FuzzHarness(Harness):
    """The harness's engine loop, with sampled-token logprob rows in the
    runner output."""

    engine_logprobs = True


def run_episode(spec: EpisodeSpec, raise_exceptions: bool = False) -> Result:
    from vllm.v1.request import RequestStatus

    res = Result()
    h = FuzzHarness(spec.backend, async_scheduling=spec.async_scheduling,
                num_spec_tokens=spec.num_spec_tokens, block_size=4,
                num_blocks=spec.num_blocks, max_num_seqs=8,
                max_num_batched_tokens=64)
    sched = h.scheduler
    chk = inv.instrument(sched)
    inv.set_mode(sched, "record", res.violations.append)
    rids: dict[str, RequestSpec] = {f"q{i}": rs
                                    for i, rs in enumerate(spec.requests)}
    model = _Model(h, spec, rids)
    h.engine_setup(spec.depth,
                   sampler=model.sampler,
                   drafter=model.drafter if spec.num_spec_tokens else None)
    added: set[str] = set()
    try:
        for step in range(120):
            for rid, rs in rids.items():
                if rid not in added and rs.arrive <= step:
                    _add(h, rid, rs)
                    added.add(rid)
                elif rid in added and rs.abort_at == step and \
                        not h.request(rid).is_finished():
                    sched.finish_requests([rid],
                                          RequestStatus.FINISHED_ABORTED)
            h.engine_step()
            res.steps += 1
            if len(added) == len(rids) and not sched.has_requests() \
                    and not h.batch_queue:
                break
        live = [r for r in added if not h.request(r).is_finished()]
        if live:
            sched.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        for _ in range(10):
            if not h.batch_queue and not sched.has_requests():
                break
            h.engine_step()
        chk.check_idle()
    except Exception as exc:  # noqa: BLE001
        if raise_exceptions:
            raise
        res.violations.append(inv.Violation(
            "exception", None, f"{type(exc).__name__}: {exc}",
            {"traceback": traceback.format_exc(limit=8)}))
    res.finished = sum(1 for r in added if h.request(r).is_finished())
    return res


def _add(h: Harness, rid: str, rs: RequestSpec) -> None:
    kw: dict[str, Any] = {}
    if rs.grammar is not None:
        kind, g, _ = GRAMMARS[rs.grammar]
        kw[kind] = g
    h.add_request(h.encode(PROMPTS[rs.prompt]), request_id=rid,
                  ignore_eos=rs.ignore_eos, max_tokens=rs.max_tokens,
                  min_tokens=min(rs.min_tokens, rs.max_tokens), logprobs=rs.logprobs,
                  stop_token_ids=[h.tok("z")] if rs.stop else None, **kw)


def describe(spec: EpisodeSpec) -> str:
    return repr(spec)
