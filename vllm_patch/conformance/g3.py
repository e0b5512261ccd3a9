"""G3 scenarios: drafts are never verified against a row that allows
post-terminal tokens (worker side of G2).

Each scenario drives the real `Scheduler` / `AsyncScheduler` with a real
grammar (`vllm_patch.testing.harness`), builds the real grammar bitmask, and
then samples through the real V1 runner entry point
`GPUModelRunner.sample_tokens` (patched or stock) on a stand-in runner
object: vLLM's own `apply_grammar_bitmask` and V1 `rejection_sample` (greedy)
run on real CPU tensors (where vLLM's compiled extension is absent, e.g. a
bare Python tree, the greedy kernel's rule in Python); only the model (its
logits) is scripted. Under async scheduling the stand-in verifies the
WORKER's drafts, as the V1 runner does, not the scheduler's -1-padded copy.

Checked per scenario (violations listed, [] = G3 holds):
- rows after a terminal draft allow only the grammar's stop tokens;
- rows after the first -1 (grammar-invalid / unvalidated) draft are the
  grammar's row for the valid prefix, never all-ones;
- the runner accepts no draft at or after position num_acceptable_drafts;
- the token sampled right after a terminal is a stop token;
- spec-decode stats: accepted <= drafted, per position too.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any, Callable

from vllm_patch.conformance import Scenario

# Logit the scripted target gives its preferred token; every other token
# gets a small logit, the tokenizer EOS a little more (a stop-only row then
# samples EOS, an all-ones row samples the preferred token).
_PREFERRED, _EOS_BIAS = 10.0, 1.0


_KERNELS_READY = False


class _Sampled(Exception):
    def __init__(self, sampled: list[list[int]]) -> None:
        self.sampled = sampled


class _RunnerHelpers:
    """A stand-in's missing methods are the V1 GPUModelRunner's own (the
    helpers a vLLM build that carries G3's runner side calls on self from
    sample_tokens and propose_draft_token_ids); other attributes stay
    missing."""

    def __getattr__(self, name: str) -> Any:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        attr = GPUModelRunner.__dict__.get(name)
        if callable(attr):
            return attr.__get__(self)
        raise AttributeError(name)


class _StandInRunner(_RunnerHelpers):
    """Just enough of a V1 GPUModelRunner for `sample_tokens` to reach the
    sampler: the state execute_model() leaves, the batch order, and a
    `_sample` that runs vLLM's V1 greedy rejection sampler."""

    def __init__(self, state: Any, req_ids: list[str]) -> None:
        self.execute_model_state = state
        self.input_batch = SimpleNamespace(req_ids=req_ids)
        self.kv_connector_output = None
        self.use_async_scheduling = True

    def _sample(self, logits: Any, meta: Any) -> Any:
        import torch
        from vllm.v1.sample.rejection_sampler import rejection_sample

        target = logits[meta.target_logits_indices]
        bonus = logits[meta.bonus_logits_indices].argmax(dim=-1).to(torch.int64)
        if importlib.util.find_spec("vllm._C") is None:
            # vLLM's Python tree without its compiled extension: no kernel
            # to run, so the V1 greedy kernel's rule
            # (rejection_greedy_sample_kernel) in Python.
            out = _greedy_rule(meta, target.argmax(dim=-1).tolist(), bonus.tolist())
        else:  # the real sampler; a changed API is an error of the scenario
            out = rejection_sample(
                meta.draft_token_ids, meta.num_draft_tokens, meta.max_spec_len,
                meta.cu_num_draft_tokens, None, target, bonus.contiguous(),
                SimpleNamespace(all_greedy=True, all_random=False, generators={}),
            )
        return SimpleNamespace(sampled_token_ids=out)

    def _update_states_after_model_execute(self, sampled_token_ids: Any,
                                           scheduler_output: Any) -> None:
        raise _Sampled([[int(t) for t in row if int(t) >= 0]
                        for row in sampled_token_ids.tolist()])


def _greedy_rule(meta: Any, argmax: list[int], bonus: list[int]) -> Any:
    import torch

    drafts = meta.draft_token_ids.tolist()
    out = torch.full((len(meta.num_draft_tokens), meta.max_spec_len + 1), -1,
                     dtype=torch.int32)
    start = 0
    for r, n in enumerate(meta.num_draft_tokens):
        rejected = False
        for pos in range(n):
            out[r, pos] = argmax[start + pos]
            if drafts[start + pos] != argmax[start + pos]:
                rejected = True
                break
        if not rejected:
            out[r, n] = bonus[r]
        start += n
    return out


def v1_runner_sample(h: Any, so: Any, grammar_output: Any,
                     worker_drafts: dict[str, list[int]],
                     target: dict[str, list[int]]) -> dict[str, list[int]]:
    """Sample one step the way the V1 runner does. `worker_drafts`: the
    drafts in the runner's input_ids (async: its own); `target[rid][i]`: the
    model's preferred token at position i (drafts + bonus)."""
    import numpy as np
    import torch
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import ExecuteModelState, GPUModelRunner

    global _KERNELS_READY
    if not _KERNELS_READY:
        # What every worker does at start (worker_base): the CPU platform's
        # C++ stand-ins for the Triton sampling kernels.
        from vllm.platforms import current_platform

        current_platform.register_triton_kernel_overrides()
        _KERNELS_READY = True
    req_ids = list(so.num_scheduled_tokens)
    vocab = grammar_output.grammar_bitmask.shape[1] * 32 if grammar_output \
        is not None else h.vllm_config.model_config.get_vocab_size()
    vocab = min(vocab, h.vllm_config.model_config.get_vocab_size())
    num_drafts = [len(so.scheduled_spec_decode_tokens.get(r, ())) for r in req_ids]
    rows = []
    drafts: list[int] = []
    for r, n in zip(req_ids, num_drafts):
        wd = list(worker_drafts.get(r, so.scheduled_spec_decode_tokens.get(r, ())))
        drafts.extend((wd + [-1] * n)[:n])
        pref = list(target.get(r, []))
        for i in range(n + 1):
            row = np.zeros(vocab, dtype=np.float32)
            row[1] = _EOS_BIAS
            if i < len(pref):
                row[pref[i]] = _PREFERRED
            rows.append(row)
    logits = torch.from_numpy(np.stack(rows))
    n_arr = np.array(num_drafts)
    cu_sampled = np.cumsum(n_arr + 1)
    starts = cu_sampled - (n_arr + 1)
    target_idx = np.concatenate([s + np.arange(n) for s, n in zip(starts, n_arr)]
                                or [np.zeros(0, dtype=np.int64)])
    meta = SpecDecodeMetadata(
        draft_token_ids=torch.tensor(drafts, dtype=torch.int32),
        num_draft_tokens=num_drafts,
        cu_num_draft_tokens=torch.tensor(np.cumsum(n_arr), dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor(cu_sampled, dtype=torch.int32),
        target_logits_indices=torch.tensor(target_idx, dtype=torch.int64),
        bonus_logits_indices=torch.tensor(cu_sampled - 1, dtype=torch.int64),
        logits_indices=torch.arange(int(cu_sampled[-1]), dtype=torch.int64),
    )
    state = ExecuteModelState(so, logits, meta, *([None] * 7))
    runner = _StandInRunner(state, req_ids)
    try:
        GPUModelRunner.sample_tokens(runner, grammar_output)  # type: ignore[arg-type]
    except _Sampled as done:
        return dict(zip(req_ids, done.sampled))
    raise AssertionError("sample_tokens did not reach the sampler")


def _stop_ids(h: Any, rid: str) -> set[int]:
    """Tokens a grammar may end on (xgrammar: its stop set; guidance and
    outlines: the tokenizer EOS)."""
    from vllm_patch.testing.harness import EOS

    g = h.grammar(rid)
    matcher = getattr(g, "matcher", None)
    if matcher is not None and getattr(matcher, "stop_token_ids", None):
        return {int(t) for t in matcher.stop_token_ids}
    return {EOS}


def sample_step(h: Any, worker_drafts: dict[str, list[int]],
                target: dict[str, list[int]], *,
                async_: bool) -> tuple[Any, Any, dict]:
    """Apply one decode step (async: the oldest in-flight one) through the
    V1 runner stand-in; returns (record, grammar_output, sampled)."""
    from vllm.v1.outputs import DraftTokenIds

    if async_:
        so = h.in_flight.popleft()
        ids = list(worker_drafts)
        h.scheduler.update_draft_token_ids_in_output(
            DraftTokenIds(ids, [list(worker_drafts[r]) for r in ids]), so)
        so._vllm_patch_record.spec_tokens = {
            k: list(v) for k, v in so.scheduled_spec_decode_tokens.items()}
    else:
        so = h.schedule()
    h.grammar_bitmask(so)  # records rows + num_acceptable_drafts
    go = h.scheduler.get_grammar_bitmask(so)
    sampled = v1_runner_sample(h, so, go, worker_drafts if async_ else {}, target)
    so._vllm_patch_record.grammar_invalid = _grammar_invalid(h, sampled)
    h.run_model(so, sampled)
    return so._vllm_patch_record, go, sampled


def _grammar_invalid(h: Any, sampled: dict[str, list[int]]) -> list[str]:
    """Requests whose sampled tokens the grammar (before this step's
    advance) rejects; tokens after a terminal are the business of G2."""
    bad = []
    for rid, got in sampled.items():
        if h.request(rid).structured_output_request is None:
            continue
        g = h.grammar(rid)
        if g is not None and got and not g.is_terminated():
            valid = g.validate_tokens(list(got))
            if valid != got[:len(valid)] or (len(valid) < len(got)
                                              and not _ends_at_stop(h, rid, valid)):
                bad.append(rid)
    return bad


def _ends_at_stop(h: Any, rid: str, valid: list[int]) -> bool:
    return bool(valid) and valid[-1] in _stop_ids(h, rid)


def _check(h: Any, rid: str, record: Any, sampled: dict[str, list[int]],
           terminal_at: int | None, invalid_at: int | None) -> list[str]:
    """G3 checks for one request's step (positions are draft indices)."""
    v: list[str] = []
    rows = record.bitmask_rows[rid]
    n_acc = record.num_acceptable_drafts[rid]
    allowed = [h.allowed(r) for r in rows]
    vocab = len(h.tokenizer)
    stops = _stop_ids(h, rid)
    got = sampled[rid]
    if len(got) - 1 > n_acc:
        v.append(f"{rid}: runner accepted {len(got) - 1} drafts, only {n_acc} "
                 f"acceptable (sampled {got})")
    if terminal_at is not None:
        for i in range(terminal_at + 1, len(rows)):
            a = allowed[i]
            if not a or not set(a) <= stops:
                v.append(f"{rid}: row {i} after the terminal draft allows "
                         f"{'all' if len(a) >= vocab else len(a)} tokens, "
                         f"not only stop tokens {sorted(stops)}")
        if len(got) > terminal_at + 1 and got[terminal_at + 1] not in stops:
            v.append(f"{rid}: token {got[terminal_at + 1]} sampled after the "
                     f"terminal is not a stop token")
    if invalid_at is not None:
        for i in range(invalid_at + 1, len(rows)):
            if allowed[i] != allowed[invalid_at]:
                v.append(f"{rid}: row {i} after the first invalid draft allows "
                         f"{'all' if len(allowed[i]) >= vocab else len(allowed[i])}"
                         f" tokens, not the valid-prefix row")
    d, a, per_pos = h.spec_totals()
    if a > d:
        v.append(f"spec stats: {a} accepted > {d} drafted")
    return v


def _post_terminal(backend: str, ignore_eos: bool, async_: bool) -> Callable[[], list[str]]:
    def run() -> list[str]:
        from vllm_patch.testing.harness import EOS, Harness

        h = Harness(backend, num_spec_tokens=3, async_scheduling=async_)
        rid = h.add_request(regex="ab", ignore_eos=ignore_eos, logprobs=1)
        a, b, c, d = (h.tok(x) for x in "abcd")
        if async_:
            h.launch()                                   # prefill
            h.launch(drafts={rid: [b, EOS, c]})          # worker's drafts
            h.finish_oldest({rid: [a]})
            record, _, sampled = sample_step(h, {rid: [b, EOS, c]},
                                             {rid: [b, EOS, c, d]}, async_=True)
        else:
            h.step({rid: [a]}, drafts={rid: [b, EOS, c]})  # validated: [b, EOS]
            record, _, sampled = sample_step(h, {}, {rid: [b, EOS, c]}, async_=False)
        v = _check(h, rid, record, sampled, terminal_at=1, invalid_at=None)
        h.drain()
        return v

    return run


def _invalid(async_unvalidated: bool) -> Callable[[], list[str]]:
    def run() -> list[str]:
        from vllm_patch.testing.harness import Harness

        h = Harness("xgrammar", num_spec_tokens=3, async_scheduling=True)
        rid = h.add_request(regex="abc", logprobs=1)
        a, b, c, x = (h.tok(t) for t in "abcx")
        h.launch()
        if async_unvalidated:
            # The worker's drafts never reach the scheduler (placeholders
            # stay -1): the scheduler validated nothing.
            h.launch(drafts=None)
            h.finish_oldest({rid: [a]})
            so = h.in_flight.popleft()
            h.grammar_bitmask(so)
            go = h.scheduler.get_grammar_bitmask(so)
            worker = {rid: [b, x, x]}
            sampled = v1_runner_sample(h, so, go, worker, {rid: [b, x, x, x]})
            so._vllm_patch_record.grammar_invalid = _grammar_invalid(h, sampled)
            h.run_model(so, sampled)
            record, invalid_at = so._vllm_patch_record, 0
        else:
            h.launch(drafts={rid: [b, x, c]})           # x is invalid
            h.finish_oldest({rid: [a]})
            record, _, sampled = sample_step(h, {rid: [b, x, c]},
                                             {rid: [b, x, c, x]}, async_=True)
            invalid_at = 1
        v = _check(h, rid, record, sampled, terminal_at=None,
                   invalid_at=invalid_at)
        if rid in record.grammar_invalid:
            v.append(f"{rid}: sampled {sampled[rid]} is not grammar-valid after 'a'")
        h.drain()
        return v

    return run


# ---------------------------------------------------------------------------
# No draft proposals after the grammar's end (g3-no-drafts-after-grammar-end).
# The patched `GPUModelRunner.propose_draft_token_ids` runs on a stand-in
# runner (what the method reads before the drafter runs) with the real
# bitmask of a real scheduler step; the drafter is a DraftModelProposer that
# raises as soon as the stock path touches it.


class DrafterRan(Exception):
    """The stock proposer path reached the drafter."""


def drafter_standin() -> Any:
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    class Drafter(DraftModelProposer):  # passes stock's isinstance check
        def prepare_next_token_ids_padded(self, *a: Any, **k: Any) -> Any:
            raise DrafterRan()

        def propose(self, *a: Any, **k: Any) -> Any:
            raise DrafterRan()

    return object.__new__(Drafter)


class ProposerStandIn(_RunnerHelpers):
    """Just what propose_draft_token_ids reads before its drafter runs."""

    def __init__(self, req_ids: list[str], sampling_params: dict[str, Any],
                 async_: bool = False, k: int = 3) -> None:
        import numpy as np
        import torch

        self.speculative_config = SimpleNamespace(
            method="draft_model", use_eagle=lambda: False,
            uses_draft_model=lambda: True, use_dflash=lambda: False,
            use_ngram_gpu=lambda: False, uses_extract_hidden_states=lambda: False,
            disable_padded_drafter_batch=False)
        self.parallel_config = SimpleNamespace(pipeline_parallel_size=1,
                                               data_parallel_size=1)
        self.vllm_config = SimpleNamespace(
            structured_outputs_config=SimpleNamespace(reasoning_parser=""))
        self.input_batch = SimpleNamespace(req_ids=list(req_ids))
        self.requests = {r: SimpleNamespace(sampling_params=sampling_params[r])
                         for r in req_ids}
        self.discard_request_mask = SimpleNamespace(
            np=np.zeros(len(req_ids), dtype=bool), gpu=None)
        self.num_spec_tokens = k
        self.device = torch.device("cpu")
        self.use_async_scheduling = async_
        self.valid_sampled_token_count_event = None
        self.drafter = drafter_standin()
        self._draft_probs = None
        self._draft_prob_req_ids = None

    def set_batch(self, req_ids: list[str]) -> None:
        import numpy as np

        self.input_batch.req_ids = list(req_ids)
        self.discard_request_mask.np = np.zeros(len(req_ids), dtype=bool)


def grammar_output_of(record: Any, req_ids: list[str]) -> Any:
    """The GrammarOutput of a harness step (rows packed 1 + drafts each)."""
    import numpy as np
    from vllm.v1.core.sched.output import GrammarOutput

    return GrammarOutput(list(req_ids),
                         np.concatenate([record.bitmask_rows[r] for r in req_ids]))


def propose_once(runner: Any, grammar_output: Any, spec: dict[str, list[int]],
                 sampled: list[list[int]]) -> str:
    """One sample step's proposer call: "drafter" if the drafter ran, else
    "skipped" (zero drafts of shape [num_reqs, k] returned)."""
    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_patch.v1.worker.gpu_model_runner import g3_drafts as g3

    # What sample_tokens records for the proposer before it runs: the
    # plugin's step context, or that of a vLLM build that carries G3's
    # runner side (its own method; absent on the release).
    g3.begin_step(runner, grammar_output)
    start = GPUModelRunner.__dict__.get("_start_grammar_step")
    if start is not None:
        start(runner, grammar_output)
    so = SimpleNamespace(total_num_scheduled_tokens=sum(map(len, sampled)),
                         num_spec_tokens_to_schedule=runner.num_spec_tokens,
                         scheduled_spec_decode_tokens=spec,
                         has_structured_output_requests=True)
    k1 = runner.num_spec_tokens + 1
    tensor = torch.tensor([list(t) + [-1] * (k1 - len(t)) for t in sampled],
                          dtype=torch.int32)
    try:
        out = GPUModelRunner.propose_draft_token_ids(
            runner, so, tensor, None, None, None, None, None, None, None)
    except DrafterRan:
        return "drafter"
    finally:
        runner.__dict__[g3._GRAMMAR_ATTR] = None  # noqa: SLF001
    if tuple(out.shape) != (len(runner.input_batch.req_ids), runner.num_spec_tokens) \
            or bool(out.any()):
        return f"bad drafts {out.tolist()}"
    return "skipped"


def _draft_skip(async_: bool, goes_on: bool) -> Callable[[], list[str]]:
    def run() -> list[str]:
        from vllm_patch.testing.harness import EOS, Harness

        h = Harness("xgrammar", num_spec_tokens=3)
        a, b = h.tok("a"), h.tok("b")
        t = h.add_request(regex="ab", ignore_eos=True)
        n = h.add_request(regex="a[ab]*", ignore_eos=True)
        h.step({t: [a], n: [a]}, drafts={t: [b, EOS], n: [b, b]})
        so = h.schedule()
        h.grammar_bitmask(so)
        go = grammar_output_of(so._vllm_patch_record, [t, n])
        spec = {r: list(v) for r, v in so.scheduled_spec_decode_tokens.items()}
        params = {r: h.request(r).sampling_params for r in (t, n)}
        runner = ProposerStandIn([t, n], params, async_)
        # T samples EOS after b (its grammar ends); N ends too, or goes on.
        got = propose_once(runner, go, spec,
                           [[b, EOS], [b, b, a] if goes_on else [b, b, EOS]])
        v = []
        if goes_on:
            if got != "drafter":
                v.append(f"drafter {got} although request {n} goes on")
            return v
        if got != "skipped":
            v.append(f"drafter ran ({got}) for a batch whose every grammar ended")
        if async_:
            # The follow-up step was in flight; the scheduler has finished
            # both and leaves them out of the grammar output.
            got = propose_once(runner, None, spec, [[b, a, b, a], [a, a, a, a]])
            if got != "skipped":
                v.append(f"drafter ran ({got}) in the in-flight step after the end")
        return v

    return run


def _post_terminal_stock(stops: str) -> tuple[str, ...]:
    """Stock, async: the V1 runner verifies the worker's draft c after
    [b, EOS] against all-ones rows and accepts it (ids: a 70, b 71, c 72,
    d 73, EOS 1)."""
    return ("r0: runner accepted 3 drafts, only 2 acceptable (sampled "
            "[71, 1, 72, 73])",
            f"r0: row 2 after the terminal draft allows all tokens, not only "
            f"stop tokens {stops}",
            f"r0: row 3 after the terminal draft allows all tokens, not only "
            f"stop tokens {stops}",
            "r0: token 72 sampled after the terminal is not a stop token",
            "spec stats: 3 accepted > 2 drafted")


def _rows_after_invalid(first: int) -> tuple[str, ...]:
    return tuple(f"r0: row {i} after the first invalid draft allows all "
                 "tokens, not the valid-prefix row" for i in range(first, 4))


SCENARIOS: list[Scenario] = [
    Scenario("g3-async-post-terminal-draft-xgrammar", "G3",
             "async, V1 runner, xgrammar: worker drafts [b, EOS, c] after 'a' "
             "(regex ab); c must not be verified against an all-ones row",
             _post_terminal("xgrammar", ignore_eos=False, async_=True),
             stock_violations=_post_terminal_stock("[1, 3]")),
    Scenario("g3-async-post-terminal-draft-ignore-eos", "G3",
             "as above with ignore_eos=True (grammar stops: EOS, <|im_end|>)",
             _post_terminal("xgrammar", ignore_eos=True, async_=True),
             stock_violations=_post_terminal_stock("[1, 3]")),
    Scenario("g3-async-post-terminal-draft-guidance", "G3",
             "async, V1 runner, guidance, ignore_eos=True",
             _post_terminal("guidance", ignore_eos=True, async_=True),
             stock_violations=_post_terminal_stock("[1]")),
    Scenario("g3-async-post-terminal-draft-outlines", "G3",
             "async, V1 runner, outlines, ignore_eos=True",
             _post_terminal("outlines", ignore_eos=True, async_=True),
             stock_violations=_post_terminal_stock("[1]")),
    Scenario("g3-sync-bonus-after-terminal-draft", "G3",
             "sync: drafts validated to [b, EOS]; the bonus row after the "
             "terminal must allow only stop tokens",
             _post_terminal("xgrammar", ignore_eos=True, async_=False),
             stock_violations=(
                 "r0: row 2 after the terminal draft allows all tokens, not "
                 "only stop tokens [1, 3]",
                 "r0: token 72 sampled after the terminal is not a stop token")),
    Scenario("g3-async-invalid-draft", "G3",
             "async: worker drafts [b, x, c] (x invalid); rows after the "
             "first invalid position are the valid-prefix row",
             _invalid(async_unvalidated=False),
             stock_violations=_rows_after_invalid(2)),
    Scenario("g3-async-unvalidated-drafts", "G3",
             "async: worker drafts never reached the scheduler (all -1); the "
             "V1 runner must not accept them (x after 'ab' is invalid)",
             _invalid(async_unvalidated=True),
             stock_violations=(
                 "r0: runner accepted 3 drafts, only 0 acceptable (sampled "
                 "[71, 93, 93, 93])",
                 *_rows_after_invalid(1),
                 "r0: sampled [71, 93, 93, 93] is not grammar-valid after 'a'")),
    Scenario("g3-no-drafts-after-grammar-end-sync", "G3",
             "sync, V1 runner, draft_model: every request of the batch samples "
             "its grammar's stop token; the drafter must not run",
             _draft_skip(async_=False, goes_on=False),
             stock_violations=(
                 "drafter ran (drafter) for a batch whose every grammar ended",)),
    Scenario("g3-no-drafts-after-grammar-end-async", "G3",
             "async: as above, and in the in-flight follow-up step (the "
             "scheduler already finished the requests) the drafter must not run",
             _draft_skip(async_=True, goes_on=False),
             stock_violations=(
                 "drafter ran (drafter) for a batch whose every grammar ended",
                 "drafter ran (drafter) in the in-flight step after the end")),
    Scenario("g3-drafts-while-a-grammar-goes-on", "G3",
             "control: one request ends, one goes on: the drafter runs as in "
             "stock", _draft_skip(async_=True, goes_on=True), stock_fails=False),
]
