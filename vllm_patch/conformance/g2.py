"""G2 conformance scenarios: nothing past the grammar's end is committed.

Each scenario drives the real scheduler through `vllm_patch.testing.harness`
(real grammars, fake runner output) and returns the violations of G2 it
observes; [] means G2 holds. Failure classes P1-P7 and controls C1-C3 are
those of ../shared/research/vllm-rollback-audit.md. Tiny-tokenizer ids:
EOS 1 (tokenizer EOS), IM_END 3 (generation-config EOS), </think> 5.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from vllm_patch.conformance import Scenario

EOS, IM_END, THINK, END_THINK = 1, 3, 4, 5
PROMPT_TEXT = "xyzx"  # 4 single-char tokens: one full block at block_size 4


def _h(backend: str = "xgrammar", **kw: Any):
    from vllm_patch.testing.harness import Harness

    kw.setdefault("num_spec_tokens", 3)
    return Harness(backend, **kw)


def _prompt(h) -> list[int]:
    return [h.tok(c) for c in PROMPT_TEXT]


def _finished(h, rid: str) -> bool:
    return h.request(rid).is_finished()


def _drive(h, rid: str, script: list[tuple[list[int], list[int]]],
           clip: bool | None = True) -> None:
    """Sync steps: (sampled, next drafts) per step, while `rid` is
    unfinished. Sampled lists are clipped to 1 + the drafts that survived
    validation, as a real runner returns (clip=None: synthetic, unclipped)."""
    for sampled, drafts in script:
        if _finished(h, rid):
            break
        h.step({rid: sampled}, drafts={rid: drafts} if drafts else None,
               clip=clip)


def _check(h, rid: str, want: list[int], finish: str = "stop",
           stop_reason: Any = "unset", status: str | None = None,
           past: str = "after the grammar's end") -> list[str]:
    """Violations of G2 for one request whose grammar ends at `want`."""
    v: list[str] = []
    em = h.emitted(rid)
    req = h.request(rid)
    got = em.token_ids
    if got[:len(want)] == want and len(got) > len(want):
        v.append(f"emitted {len(got) - len(want)} token(s) {past}: "
                 f"{got[len(want):]}")
    elif got != want:
        v.append(f"emitted {got}, want {want}")
    if em.logprob_rows and em.logprob_rows != len(got):
        v.append(f"logprob rows {em.logprob_rows} != tokens {len(got)}")
    if em.logprob_rows > len(want):
        v.append(f"logprob rows {em.logprob_rows} > grammar-valid tokens "
                 f"{len(want)}")
    if em.finish_reason != finish:
        v.append(f"finish_reason {em.finish_reason}, want {finish}")
    if stop_reason != "unset" and em.finish_reason == finish and \
            em.stop_reason != stop_reason:
        v.append(f"stop_reason {em.stop_reason!r}, want {stop_reason!r}")
    if status and req.status.name != status:
        v.append(f"status {req.status.name}, want {status}")
    if req.is_finished() and req.num_computed_tokens > req.num_tokens - 1:
        v.append(f"num_computed_tokens {req.num_computed_tokens} > "
                 f"num_tokens - 1 = {req.num_tokens - 1}")
    d, a, _ = h.spec_totals()
    if a > d:
        v.append(f"spec stats: {d} drafts, {a} accepted")
    return v


def _idle_blocks(h) -> list[str]:
    """At idle (every step applied, no live request) every block is free."""
    live = [r for r, q in h.requests.items() if not q.is_finished()]
    v = []
    if live:
        v.append(f"requests still running after their grammar ended: {live}")
    h.drain()
    return v


def _held_at_idle(h) -> list[str]:
    live = [r for r, q in h.requests.items() if not q.is_finished()]
    held = h.held_blocks()
    v = []
    if held and live:
        v.append(f"blocks held at idle: {held} (by {live})")
    h.drain()
    if h.held_blocks():
        v.append(f"blocks leaked after drain: {h.held_blocks()}")
    return v


# ------------------------------------------------------------- P1/P2/P4/P5
def _post_terminal(backend: str, terminal: int, stop_reason: Any):
    def run() -> list[str]:
        h = _h(backend)
        a, b, c = h.tok("a"), h.tok("b"), h.tok("c")
        rid = h.add_request(_prompt(h), regex="ab", ignore_eos=True, logprobs=1)
        _drive(h, rid, [([a], [b, terminal, c]), ([b, terminal, c], []),
                        ([h.tok("d")], [])])
        return _check(h, rid, [a, b, terminal], stop_reason=stop_reason,
                      status="FINISHED_STOPPED") + _held_at_idle(h)
    return run


def _terminal_first_draft() -> list[str]:
    h = _h()
    a, c, d = h.tok("a"), h.tok("c"), h.tok("d")
    rid = h.add_request(_prompt(h), regex="a", ignore_eos=True, logprobs=1)
    _drive(h, rid, [([a], [EOS, c, d]), ([EOS, c], []), ([d], [])])
    return _check(h, rid, [a, EOS], stop_reason=None) + _held_at_idle(h)


def _terminal_bonus(backend: str):
    def run() -> list[str]:
        h = _h(backend)
        a, b, c = h.tok("a"), h.tok("b"), h.tok("c")
        rid = h.add_request(_prompt(h), regex="abc", ignore_eos=True, logprobs=1)
        # Nothing is dropped: the bonus is the terminal; finish in that pass.
        _drive(h, rid, [([a], [b, c]), ([b, c, EOS], []), ([h.tok("d")], [])])
        return _check(h, rid, [a, b, c, EOS], stop_reason=None) + _held_at_idle(h)
    return run


def _multi_step(backend: str):
    """k=3 fully accepted (k+1 tokens, no terminal), terminal on a later step."""
    def run() -> list[str]:
        h = _h(backend)
        t = [h.tok(ch) for ch in "abcde"]
        x, y = h.tok("x"), h.tok("y")
        rid = h.add_request(_prompt(h), regex="abcde", ignore_eos=True, logprobs=1)
        _drive(h, rid, [([t[0]], t[1:4]), (t[1:5], [EOS, x, y]), ([EOS, x], []),
                        ([y], [])])
        return _check(h, rid, t + [EOS], stop_reason=None) + _held_at_idle(h)
    return run


# ---------------------------------------------------------------------- P3
def _async(ignore_eos: bool, overlap: bool):
    """overlap: a third step is launched before the second is applied, so
    the request finishes with a step in flight (counters then include it)."""
    def run() -> list[str]:
        h = _h(async_scheduling=True)
        a, b, c, d = (h.tok(ch) for ch in "abcd")
        rid = h.add_request(_prompt(h), regex="ab", ignore_eos=ignore_eos,
                            logprobs=1)
        h.launch()                                  # s1: prefill
        h.launch(drafts={rid: [b, EOS, c]})         # s2: decode, drafts from s1
        h.finish_oldest({rid: [a]})
        if overlap and not _finished(h, rid):
            h.launch(drafts={rid: [d, d, d]})       # s3 in flight during s2's update
        # The V1 runner verifies its own post-terminal draft `c` against an
        # all-ones row and accepts it (audit P3): sampled [b, EOS, c, d].
        h.finish_oldest({rid: [b, EOS, c, d]})
        while h.in_flight:
            h.finish_oldest({} if _finished(h, rid) else {rid: [d, d, d, d]})
        v = _check(h, rid, [a, b, EOS], stop_reason=None)
        req = h.request(rid)
        if overlap:  # counters include the in-flight step by design
            v = [m for m in v if not m.startswith("num_computed")]
        elif req.is_finished() and req.num_output_placeholders:
            v.append(f"num_output_placeholders {req.num_output_placeholders} "
                     "after finish")
        return v + _held_at_idle(h)
    return run


# ---------------------------------------------------------------------- P6
def _rejection(backend: str):
    def run() -> list[str]:
        h = _h(backend)
        a, b, c, x, y = (h.tok(ch) for ch in "abcxy")
        rid = h.add_request(_prompt(h), regex="abc", logprobs=1)
        # Synthetic mask/commit divergence: `x` violates the grammar.
        _drive(h, rid, [([a], [b, c]), ([b, x, y], [])], clip=None)
        v = _check(h, rid, [a, b], finish="error", status="FINISHED_ERROR",
                   past="past the grammar-valid prefix")
        if h.request(rid).resumable:
            v.append("rejected request is resumable")
        return v + _held_at_idle(h)
    return run


# ---------------------------------------------------------------------- P7
def _reasoning() -> list[str]:
    h = _h(reasoning_parser="deepseek_r1")
    a, k, x, y = h.tok("a"), h.tok("k"), h.tok("x"), h.tok("y")
    rid = h.add_request(_prompt(h) + [THINK], regex="a", ignore_eos=True,
                        logprobs=1)
    _drive(h, rid, [([k], [END_THINK, a, EOS]), ([END_THINK, a, EOS, x], []),
                    ([y], [])])
    v = _check(h, rid, [k, END_THINK, a, EOS], stop_reason=None)
    if not h.request(rid).structured_output_request.reasoning_ended:
        v.append("reasoning_ended not latched")
    return v + _held_at_idle(h)


# -------------------------------------------------------- single-token steps
def _no_spec() -> list[str]:
    h = _h(num_spec_tokens=0)
    a, b, c, d = (h.tok(ch) for ch in "abcd")
    rid = h.add_request(_prompt(h), regex="ab", ignore_eos=True, logprobs=1)
    _drive(h, rid, [([a], []), ([b], []), ([EOS], []), ([c], []), ([d], [])])
    return _check(h, rid, [a, b, EOS], stop_reason=None) + _held_at_idle(h)


# ----------------------------------------------------------------- controls
def _c1() -> list[str]:
    h = _h()
    a, b, c = h.tok("a"), h.tok("b"), h.tok("c")
    rid = h.add_request(_prompt(h), regex="ab", logprobs=1)
    _drive(h, rid, [([a], [b, EOS, c]), ([b, EOS, c], [])])
    v = _check(h, rid, [a, b, EOS], stop_reason=None)
    return [x for x in v if not x.startswith("num_computed")] + _held_at_idle(h)


def _c2() -> list[str]:
    h = _h()
    a, b, c = h.tok("a"), h.tok("b"), h.tok("c")
    rid = h.add_request(_prompt(h), regex="ab", ignore_eos=True, max_tokens=2,
                        logprobs=1)
    _drive(h, rid, [([a], [b, EOS, c]), ([b, EOS, c], [])])
    v = _check(h, rid, [a, b], finish="length")
    v = [x for x in v if not x.startswith("num_computed")]
    if h.grammar(rid).is_terminated():
        v.append("grammar terminated although EOS was trimmed by max_tokens")
    return v + _held_at_idle(h)


def _c3() -> list[str]:
    h = _h()
    a, b, c = h.tok("a"), h.tok("b"), h.tok("c")
    rid = h.add_request(_prompt(h), regex="ab", ignore_eos=True,
                        stop_token_ids=[IM_END], logprobs=1)
    _drive(h, rid, [([a], [b, IM_END, c]), ([b, IM_END, c], [])])
    v = _check(h, rid, [a, b, IM_END], stop_reason=IM_END)
    return [x for x in v if not x.startswith("num_computed")] + _held_at_idle(h)


def _stop_trim_rollback() -> list[str]:
    """0.32: a stop trim (here EOS without ignore_eos) rolls back
    num_computed_tokens, sync and async."""
    v = []
    for async_ in (False, True):
        h = _h(async_scheduling=async_)
        a, b, c = h.tok("a"), h.tok("b"), h.tok("c")
        rid = h.add_request(_prompt(h), regex="ab", logprobs=1)
        if async_:
            h.launch()
            h.launch(drafts={rid: [b, EOS, c]})
            h.finish_oldest({rid: [a]})
            h.finish_oldest({rid: [b, EOS, c, c]})
        else:
            _drive(h, rid, [([a], [b, EOS, c]), ([b, EOS, c], [])])
        req = h.request(rid)
        if req.num_computed_tokens > req.num_tokens - 1:
            v.append(f"{'async' if async_ else 'sync'}: num_computed_tokens "
                     f"{req.num_computed_tokens} > num_tokens - 1 = "
                     f"{req.num_tokens - 1} after a stop trim")
        h.drain()
    return v


# ------------------------------------------- stock trims before the cut
def _grammar_at(h, rid: str, nxt: list[int], bad: list[int]) -> list[str]:
    """The grammar holds exactly the kept tokens: every token of `nxt` is
    the next valid one, every token of `bad` is not."""
    g = h.grammar(rid)
    v = []
    if g.is_terminated():
        v.append("grammar terminated past the kept tokens")
        return v
    # guidance: a complete grammar may be "stopped" (only EOS allowed, but
    # validate_tokens reports [] for EOS too) or not yet; both are the end.
    stopped = getattr(getattr(g, "ll_matcher", None), "is_stopped", None)
    for t in nxt:
        if t == EOS and stopped is not None and stopped():
            continue
        if g.validate_tokens([t]) != [t]:
            v.append(f"grammar does not accept {t} next: it is not at the "
                     "kept tokens")
    for t in bad:
        if g.validate_tokens([t]) == [t]:
            v.append(f"grammar accepts {t} next: it is behind the kept tokens")
    return v


def _stop_before_cut(backend: str):
    """max_tokens stops the request inside a step, before the grammar's end
    (and in a step with no terminal at all): the grammar holds the kept
    tokens only (the patch advanced further and rolled back). (A user stop
    token cannot serve here: xgrammar compiles it into the grammar.)"""
    def run() -> list[str]:
        v = []
        for regex, step, nxt, bad in (("abc", "bc", [EOS], ["c"]),
                                      ("abcde", "bcd", ["d"], ["c"])):
            h = _h(backend)
            t = {ch: h.tok(ch) for ch in "abcde"}
            a, b, c = t["a"], t["b"], t["c"]
            tail = [t[ch] for ch in step] + ([EOS] if regex == "abc" else [])
            rid = h.add_request(_prompt(h), regex=regex, ignore_eos=True,
                                max_tokens=3, logprobs=1)
            _drive(h, rid, [([a], tail[:3]), (tail, [])])
            v += [f"{regex}: {m}" for m in
                  _check(h, rid, [a, b, c], finish="length")
                  if not m.startswith("num_computed")]
            conv = lambda xs: [x if isinstance(x, int) else t[x] for x in xs]
            v += [f"{regex}: {m}" for m in
                  _grammar_at(h, rid, conv(nxt), conv(bad))]
            v += _held_at_idle(h)
        return v
    return run


def _reasoning_trim(max_tokens: int):
    """max_tokens trims the step before </think> (2) or right after it (3):
    reasoning_ended latched only if </think> was kept, grammar untouched."""
    def run() -> list[str]:
        h = _h(reasoning_parser="deepseek_r1")
        a, k = h.tok("a"), h.tok("k")
        rid = h.add_request(_prompt(h) + [THINK], regex="a", ignore_eos=True,
                            logprobs=1, max_tokens=max_tokens)
        _drive(h, rid, [([k], [k, END_THINK, a]), ([k, END_THINK, a, EOS], [])])
        want = [k, k, END_THINK][:max_tokens]
        v = _check(h, rid, want, finish="length")
        v = [m for m in v if not m.startswith("num_computed")]
        ended = h.request(rid).structured_output_request.reasoning_ended
        if bool(ended) != (END_THINK in want):
            v.append(f"reasoning_ended {ended} with kept {want}")
        v += _grammar_at(h, rid, [a], [])
        return v + _idle_blocks(h)
    return run


# ------------------------------------------------------ KV / prefix cache
def _prefix_probe(block_size: int):
    """The dropped token `c` completes a block; no later request may get a
    prefix-cache hit through it."""
    def run() -> list[str]:
        h = _h(block_size=block_size)
        a, b, c, d, q = (h.tok(ch) for ch in "abcdq")
        prompt = _prompt(h)
        rid = h.add_request(prompt, regex="ab", ignore_eos=True, logprobs=1)
        _drive(h, rid, [([a], [b, EOS, c]), ([b, EOS, c], []), ([d], []),
                        ([d], [])])
        kept = len(prompt) + 3  # prompt + a b EOS
        probe = prompt + [a, b, EOS, c, d, q]
        hit = h.prefix_hit(probe)
        v = _check(h, rid, [a, b, EOS], stop_reason=None)
        if hit > kept:
            v.append(f"prefix-cache hit {hit} tokens > {kept} committed: a "
                     "cached block holds dropped tokens")
        req = h.request(rid)
        nh = len(req.block_hashes)
        if nh * block_size > kept:
            v.append(f"{nh} block hashes cover {nh * block_size} tokens > "
                     f"{kept} committed")
        return v + _held_at_idle(h)
    return run


# --------------------------------------------------------------- concurrency
def _mixed() -> list[str]:
    """Structured requests ending at the first draft, a middle draft and the
    bonus, next to unstructured ones, in the same batches."""
    h = _h()
    a, b, c, d, x = (h.tok(ch) for ch in "abcdx")
    p = _prompt(h)
    s1 = h.add_request(p, regex="a", ignore_eos=True, logprobs=1)
    s2 = h.add_request(p, regex="ab", ignore_eos=True, logprobs=1)
    s3 = h.add_request(p, regex="abc", ignore_eos=True, logprobs=1)
    u1 = h.add_request(p, ignore_eos=True, logprobs=1, max_tokens=6)
    u2 = h.add_request(p, logprobs=1, max_tokens=20)
    script = {
        s1: [([a], [EOS, c, d]), ([EOS, c], []), ([d], [])],
        s2: [([a], [b, EOS, c]), ([b, EOS, c], []), ([d], [])],
        s3: [([a], [b, c]), ([b, c, EOS], []), ([d], [])],
        u1: [([x], [EOS, x, x]), ([EOS, x, x, x], []), ([x], [x, x, x])],
        u2: [([x], [x, x, x]), ([x, x, EOS, x], []), ([x], [])],
    }
    for i in range(3):
        live = {r: s[i] for r, s in script.items() if not _finished(h, r)}
        if not live:
            break
        h.step({r: s[0] for r, s in live.items()},
               drafts={r: s[1] for r, s in live.items() if s[1]})
    v = []
    for rid, want in ((s1, [a, EOS]), (s2, [a, b, EOS]), (s3, [a, b, c, EOS])):
        v += [f"{rid}: {m}" for m in _check(h, rid, want, stop_reason=None)]
    # Unstructured: exactly what stock check_stop gives.
    if h.emitted(u1).token_ids != [x, EOS, x, x, x, x] or \
            h.emitted(u1).finish_reason != "length":
        v.append(f"{u1} (unstructured, ignore_eos): {h.emitted(u1)}")
    if h.emitted(u2).token_ids != [x, x, x, EOS] or \
            h.emitted(u2).finish_reason != "stop":
        v.append(f"{u2} (unstructured): {h.emitted(u2)}")
    return v + _held_at_idle(h)


def _all_free() -> list[str]:
    """Sync and async, every backend: once every grammar has ended and every
    step is applied, every block is free again."""
    v = []
    for backend in ("xgrammar", "guidance", "outlines"):
        for async_ in (False, True):
            h = _h(backend, async_scheduling=async_)
            a, b, c = h.tok("a"), h.tok("b"), h.tok("c")
            rid = h.add_request(_prompt(h), regex="ab", ignore_eos=True)
            if async_:
                h.launch()
                h.launch(drafts={rid: [b, EOS, c]})
                h.finish_oldest({rid: [a]})
                h.finish_oldest({rid: [b, EOS, c]})
            else:
                _drive(h, rid, [([a], [b, EOS, c]), ([b, EOS, c], [])])
            held = h.held_blocks()
            if held:
                v.append(f"{backend}/{'async' if async_ else 'sync'}: blocks "
                         f"held at idle: {held}")
            h.drain()
            if h.held_blocks():
                v.append(f"{backend}: {h.held_blocks()} blocks leaked")
    return v


def _s(name: str, description: str, run: Callable[[], list[str]],
       stock_fails: bool = True, series: tuple[str, ...] = ("0.32", "0.33"),
       stock: Sequence[str] | Mapping[str, Sequence[str]] = ()) -> Scenario:
    return Scenario(name=name, guarantee="G2", description=description, run=run,
                    stock_fails=stock_fails, series=series,
                    stock_violations=stock)


# Stock's violations name tiny-tokenizer ids: a 70, b 71, c 72, d 73, x 93,
# y 94 (EOS 1, <|im_end|> 3, </think> 5).
_NOT_STOPPED = "finish_reason None, want stop"
_RUNNING = "status RUNNING, want FINISHED_STOPPED"
_HELD_R0 = "blocks held at idle: {} (by ['r0'])"


def _after_end(tokens: list[int]) -> str:
    return f"emitted {len(tokens)} token(s) after the grammar's end: {tokens}"


def _rows(rows: int, valid: int) -> str:
    return f"logprob rows {rows} > grammar-valid tokens {valid}"


SCENARIOS: list[Scenario] = [
    _s("g2-xgrammar-eos-mid-step",
       "xgrammar, ignore_eos, drafts [b, EOS], bonus c after the terminal",
       _post_terminal("xgrammar", EOS, None),
       stock=(_after_end([72, 73]), _rows(5, 3), _NOT_STOPPED, _RUNNING,
              _HELD_R0.format(2))),
    _s("g2-terminal-first-draft",
       "the first draft is the terminal, bonus after it",
       _terminal_first_draft,
       stock=(_after_end([72, 73]), _rows(4, 2), _NOT_STOPPED,
              _HELD_R0.format(2))),
    _s("g2-terminal-bonus",
       "the bonus token is the terminal: nothing dropped, finish now",
       _terminal_bonus("xgrammar"),
       stock=(_after_end([73]), _rows(5, 4), _NOT_STOPPED, _HELD_R0.format(2))),
    _s("g2-genconfig-eos",
       "terminal is the generation-config EOS <|im_end|> under ignore_eos",
       _post_terminal("xgrammar", IM_END, IM_END),
       stock=(_after_end([72, 73]), _rows(5, 3), _NOT_STOPPED, _RUNNING,
              _HELD_R0.format(2))),
    _s("g2-async-post-terminal-drafts",
       "AsyncScheduler, runner accepts its post-terminal draft; ignore_eos",
       _async(True, overlap=False),
       stock=(_after_end([72, 73]), _rows(5, 3), _NOT_STOPPED,
              "spec stats: 2 drafts, 3 accepted", _HELD_R0.format(2))),
    _s("g2-async-overlap",
       "AsyncScheduler with the next step in flight when the grammar ends: its output is "
       "dropped, blocks freed", _async(True, overlap=True),
       stock=(_after_end([72, 73, 73, 73, 73, 73]), _rows(9, 3), _NOT_STOPPED,
              "spec stats: 2 drafts, 6 accepted", _HELD_R0.format(3))),
    _s("g2-async-stats",
       "AsyncScheduler without ignore_eos: output right, stats 2 drafts/3 "
       "accepted on stock", _async(False, overlap=False),
       stock={"0.32": ("num_computed_tokens 8 > num_tokens - 1 = 6",
                       "spec stats: 2 drafts, 3 accepted",
                       "num_output_placeholders 2 after finish"),
              "0.33": ("spec stats: 2 drafts, 3 accepted",)}),
    _s("g2-guidance", "guidance, ignore_eos, token after EOS",
       _post_terminal("guidance", EOS, None),
       stock=(_after_end([72]), _rows(4, 3), "finish_reason error, want stop",
              "status FINISHED_ERROR, want FINISHED_STOPPED")),
    _s("g2-guidance-bonus", "guidance, terminal is the bonus",
       _terminal_bonus("guidance"),
       stock=(_after_end([73]), _rows(5, 4), _NOT_STOPPED, _HELD_R0.format(2))),
    _s("g2-outlines", "outlines, ignore_eos, token after EOS",
       _post_terminal("outlines", EOS, None),
       stock=(_after_end([72, 73]), _rows(5, 3), _NOT_STOPPED, _RUNNING,
              _HELD_R0.format(2))),
    _s("g2-outlines-bonus", "outlines, terminal is the bonus",
       _terminal_bonus("outlines"),
       stock=(_after_end([73]), _rows(5, 4), _NOT_STOPPED, _HELD_R0.format(2))),
    *[_s(f"g2-rejection-{be}",
         "a grammar-invalid token mid-step: only the valid prefix, error"
         if be == "xgrammar" else f"the same with {be}", _rejection(be),
         stock=("emitted 2 token(s) past the grammar-valid prefix: [93, 94]",
                _rows(4, 2)))
      for be in ("xgrammar", "guidance", "outlines")],
    _s("g2-reasoning-boundary",
       "</think>, grammar and terminal in one step (deepseek_r1)",
       _reasoning,
       stock=(_after_end([93, 94]), _rows(6, 4), _NOT_STOPPED,
              _HELD_R0.format(3))),
    _s("g2-no-spec-single-token-steps",
       "single-token steps, no speculation, ignore_eos: stop at the terminal",
       _no_spec,
       stock=(_after_end([72, 73]), _rows(5, 3), _NOT_STOPPED,
              _HELD_R0.format(2))),
    *[_s(f"g2-multi-step-{be}",
         f"{be}: a fully accepted k+1 step, terminal on a later step",
         _multi_step(be),
         stock=(_after_end([94] if be == "guidance" else [93, 94]),
                _rows(7 if be == "guidance" else 8, 6), _NOT_STOPPED,
                _HELD_R0.format(3)))
      for be in ("xgrammar", "guidance", "outlines")],
    _s("g2-eos-without-ignore-eos",
       "EOS terminal without ignore_eos: stock trims right",
       _c1, stock_fails=False),
    _s("g2-max-tokens-mid-step",
       "max_tokens reached before the terminal: length, grammar open",
       _c2, stock_fails=False),
    _s("g2-user-stop-token",
       "a user stop token that is also a grammar stop, ignore_eos",
       _c3, stock_fails=False),
    *[_s(f"g2-max-tokens-before-cut-{be}",
         f"{be}: max_tokens inside a step, before the terminal / in a "
         "step without one: kept tokens only, in the output and the grammar",
         _stop_before_cut(be), stock_fails=False)
      for be in ("xgrammar", "guidance", "outlines")],
    *[_s(f"g2-reasoning-trim-max-tokens-{n}",
         f"max_tokens={n} trims the step "
         f"{'before' if n == 2 else 'just after'} </think>: reasoning_ended "
         "and grammar as stock", _reasoning_trim(n), stock_fails=False)
      for n in (2, 3)],
    _s("g2-stop-trim-rollback-0.32",
       "0.32: a stop trim rolls back num_computed_tokens (as 0.33 does)",
       _stop_trim_rollback, series=("0.32",),
       stock=("sync: num_computed_tokens 7 > num_tokens - 1 = 6 after a stop "
              "trim",
              "async: num_computed_tokens 8 > num_tokens - 1 = 6 after a stop "
              "trim")),
    *[_s(f"g2-prefix-cache-probe-bs{bs}",
         f"block size {bs}: the dropped token completes a block; no later "
         "prefix hit through it", _prefix_probe(bs),
         stock=(_after_end([72, 73, 73]), _rows(6, 3), _NOT_STOPPED,
                "prefix-cache hit 8 tokens > 7 committed: a cached block holds "
                "dropped tokens",
                f"{hashes} block hashes cover {hashes * bs} tokens > 7 committed",
                _HELD_R0.format(held)))
      for bs, hashes, held in ((2, 5, 5), (4, 2, 3), (8, 1, 2))],
    _s("g2-mixed-concurrency",
       "structured (terminal at first/middle/bonus) and unstructured requests "
       "in the same batches", _mixed,
       stock=("r0: " + _after_end([72, 73]), "r0: " + _rows(4, 2),
              "r0: " + _NOT_STOPPED,
              "r1: " + _after_end([72, 73]), "r1: " + _rows(5, 3),
              "r1: " + _NOT_STOPPED,
              "r2: " + _after_end([73]), "r2: " + _rows(5, 4),
              "r2: " + _NOT_STOPPED,
              "blocks held at idle: 6 (by ['r0', 'r1', 'r2'])")),
    _s("g2-every-block-free",
       "every backend, sync and async: all blocks free once grammars ended",
       _all_free,
       # guidance: stock's grammar rejects the token after EOS, so the
       # request ends in an error and its blocks are freed.
       stock=("xgrammar/sync: blocks held at idle: 2",
              "xgrammar/async: blocks held at idle: 2",
              "outlines/sync: blocks held at idle: 2",
              "outlines/async: blocks held at idle: 2")),
]
