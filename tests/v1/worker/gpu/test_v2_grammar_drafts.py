"""Grammar-aware drafting on Model Runner V2 at unit level, CPU tensors, on
the vLLM of this run (0.32 and 0.33 both ship V2's speculators).

The real V2 speculator classes (StandaloneARSpeculator for draft models,
EagleSpeculator for EAGLE), built without their __init__ (they need a
device and a model), with a stand-in draft model whose logits the test
chooses (every structured row prefers a token its grammar forbids); their
real `sample_draft` (patched or stock), called per draft position as V2's
drafting loop does; the runner side as V2 calls it: `update_requests`
(the request's sampling parameters) and `postprocess_sampled` (the step's
sampled tokens), the registered wrappers around a stand-in for vLLM's own
body; shadow grammars compiled by a real scheduler's structured-output
manager (xgrammar, guidance).

Patched: the structured rows' drafts are grammar-valid, a position where
the grammar allows one token gets it, the unstructured row's drafts are
bit-identical to stock's argmax; after the last position the shadows are
back at the committed state and the committed grammar was never touched;
a step with walking rows dispatches the speculator's FULL CUDA graphs
eagerly and gives them back after. Stock: the structured rows propose the
forbidden token."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_patch.patching import REGISTRY, State
from vllm_patch.v1.spec_decode import grammar_drafts as gd

pytestmark = pytest.mark.scheduler

K = 4
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}},
          "required": ["ok"], "additionalProperties": False}


class _Model:
    """Stand-in draft model: the hidden states ARE the logits."""

    def compute_logits(self, hidden_states):
        return hidden_states.clone()


def _speculator(kind, vllm_config):
    if kind == "draft_model":
        from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import (
            StandaloneARSpeculator as cls)
    else:
        from vllm.v1.worker.gpu.spec_decode.eagle.speculator import (
            EagleSpeculator as cls)
    s = cls.__new__(cls)
    s.vllm_config = vllm_config
    s.device = torch.device("cpu")
    s.model = _Model()
    s.num_speculative_steps = K
    s.draft_logits = None
    s.draft_watermarker = None
    s.use_local_argmax_reduction = False
    s.dp_size = 1
    s.acceptance_estimator = None
    return s


def _runner_hook(name):
    """What V2's runner runs for `name` here: the registered wrapper around
    a stand-in for vLLM's own body when the patch is applied, else that
    stand-in alone (stock: vLLM's method does nothing for drafting)."""
    def body(*args, **kwargs):
        return None

    versions = [p for p in REGISTRY.patches.values()
                if p.name.startswith(name)
                and REGISTRY.outcomes.get(p.name) is not None
                and REGISTRY.outcomes[p.name].state is State.APPLIED]
    return versions[0].make(body) if versions else body


class _Runner:
    def __init__(self, speculator, rids):
        self.speculator = speculator
        self.is_last_pp_rank = True
        self.req_states = SimpleNamespace(
            index_to_req_id=dict(enumerate(rids)))


def _setup(backend, kind, structured_only=False):
    from vllm_patch.testing.harness import Harness

    h = Harness(backend, num_spec_tokens=K, disable_any_whitespace=True)
    rids = [h.add_request(json=SCHEMA), h.add_request(regex="abc")]
    if not structured_only:
        rids.append(h.add_request())
    for rid in rids[:2]:
        h.wait_for_grammar(rid)
    spec = _speculator(kind, h.vllm_config)
    runner = _Runner(spec, rids)
    new = [SimpleNamespace(req_id=rid, prompt_len=1, prefill_token_ids=[0],
                           sampling_params=h.request(rid).sampling_params)
           for rid in rids]
    _runner_hook("v2-grammar-drafts-requests")(
        runner, SimpleNamespace(scheduled_new_reqs=new, finished_req_ids=set()))
    return h, rids, spec, runner


def _step(h, spec, runner, rids, bad, seed=0):
    """One V2 step: postprocess_sampled (nothing sampled: -1), then the
    drafting loop's k sample_draft calls. Returns drafts, logits."""
    n = len(rids)
    _runner_hook("v2-grammar-drafts-sampled")(
        runner, torch.arange(n), torch.full((n, K + 1), -1),
        torch.ones(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32),
        None)
    vocab = h.vllm_config.model_config.get_vocab_size()
    gen = torch.Generator().manual_seed(seed)
    drafts, seen = [], []
    step = torch.tensor(0)
    for pos in range(K):
        logits = torch.randn(n, vocab, generator=gen)
        logits[:2, bad] = 100.0
        seen.append(logits.clone())
        step.fill_(pos)
        ids = spec.sample_draft(logits, torch.zeros(n, dtype=torch.long),
                                torch.arange(n), torch.zeros(n),
                                torch.zeros(n, dtype=torch.long), step, None)
        drafts.append(ids.tolist())
    return [list(col) for col in zip(*drafts)], seen


@pytest.mark.parametrize("backend,kind", [
    ("xgrammar", "draft_model"), ("guidance", "draft_model"),
    ("xgrammar", "eagle")])
def test_v2_masked_and_forced_drafts(backend, kind, patched, monkeypatch):
    monkeypatch.delenv("VLLM_PATCH_MASKED_DRAFTS", raising=False)
    monkeypatch.delenv("VLLM_PATCH_FORCED_DRAFTS", raising=False)
    h, rids, spec, runner = _setup(backend, kind)
    bad = h.tok("x")
    drafts, logits = _step(h, spec, runner, rids, bad)
    # Unstructured row: stock's argmax, bit for bit.
    assert drafts[2] == [int(l[2].argmax()) for l in logits]
    valid = {rid: h.grammar(rid).validate_tokens(d) == d
             for rid, d in zip(rids[:2], drafts[:2])}
    if not patched:
        assert not any(valid.values()), drafts  # the forbidden token drafted
        assert all(d[0] == bad for d in drafts[:2]), drafts
        return
    assert all(valid.values()), (valid, drafts)
    # regex "abc": its forced continuation fills the first drafts.
    assert drafts[1][:3] == [h.tok("a"), h.tok("b"), h.tok("c")], drafts
    stats = gd.stats(spec)
    assert stats["active"] == 1 and stats["shadows"] == 2, stats
    assert stats["positions"] > 0 and stats["forced_ahead"] > 0, stats
    # After the last position the shadows are back at the committed state
    # (the same drafts again) and the committed grammars never moved.
    t = spec.__dict__[gd.TRACKER_ATTR]
    assert t.rows is None
    again, _ = _step(h, spec, runner, rids, bad)
    assert again[:2] == drafts[:2]
    for rid, d in zip(rids[:2], drafts[:2]):
        assert h.grammar(rid).validate_tokens(d) == d


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_v2_whole_batch_drafts_from_candidates(backend, patched, monkeypatch):
    """Every row of the batch structured, top-k candidates up front (the
    accelerator's path): the drafter's choice is the candidates' first
    column, not an argmax of its own; the drafts equal the CPU path's."""
    if not patched:
        pytest.skip("no grammar-aware drafting in stock vLLM")
    monkeypatch.delenv("VLLM_PATCH_MASKED_DRAFTS", raising=False)
    monkeypatch.delenv("VLLM_PATCH_FORCED_DRAFTS", raising=False)
    out = {}
    for upfront in (False, True):
        monkeypatch.setattr(gd, "CANDIDATES_UPFRONT", upfront)
        h, rids, spec, runner = _setup(backend, "draft_model",
                                       structured_only=True)
        out[upfront], _ = _step(h, spec, runner, rids, h.tok("x"))
        assert gd.stats(spec)["positions"] > 0
    assert out[True] == out[False], out
    for rid, d in zip(rids, out[True]):
        assert h.grammar(rid).validate_tokens(d) == d


@pytest.mark.patched_only
def test_v2_switches_off_is_stock(patched, monkeypatch):
    monkeypatch.setenv("VLLM_PATCH_MASKED_DRAFTS", "0")
    monkeypatch.setenv("VLLM_PATCH_FORCED_DRAFTS", "0")
    h, rids, spec, runner = _setup("xgrammar", "draft_model")
    bad = h.tok("x")
    drafts, _ = _step(h, spec, runner, rids, bad)
    assert all(d[0] == bad for d in drafts[:2]), drafts
    assert gd.stats(spec)["active"] == 0


@pytest.mark.patched_only
def test_v2_not_eligible_probabilistic(patched, monkeypatch):
    """Probabilistic drafting (V2 caches the draft logits for the rejection
    sampler): stock drafting, said once."""
    monkeypatch.delenv("VLLM_PATCH_MASKED_DRAFTS", raising=False)
    from vllm_patch.testing.harness import Harness

    h = Harness("xgrammar", num_spec_tokens=K, disable_any_whitespace=True)
    spec = _speculator("draft_model", h.vllm_config)
    spec.draft_logits = torch.zeros(1, K, 8)
    assert not gd.drafter_eligible(spec)
    assert gd.tracker(spec) is None
    assert "not a single-token" in spec.__dict__[gd.TRACKER_ATTR].reason_off


@pytest.mark.patched_only
def test_v2_walking_step_runs_graphs_eagerly(patched, monkeypatch):
    """EAGLE's FULL graphs (prefill and the multi-step decode loop): eager
    in a step with walking rows, replayed again after its last position."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    monkeypatch.delenv("VLLM_PATCH_MASKED_DRAFTS", raising=False)

    class _Manager:
        def dispatch(self, num_reqs, num_tokens, uniform_token_count,
                     num_active_loras=0, max_query_len=None, num_ubatches=1):
            return BatchExecutionDescriptor(
                cg_mode=CUDAGraphMode.FULL, num_tokens=8, num_reqs=4)

    h, rids, spec, runner = _setup("xgrammar", "eagle")
    spec.prefill_cudagraph_manager = _Manager()
    spec.decode_cudagraph_manager = _Manager()
    n = len(rids)
    _runner_hook("v2-grammar-drafts-sampled")(
        runner, torch.arange(n), torch.full((n, K + 1), -1),
        torch.ones(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32),
        None)
    for m in (spec.prefill_cudagraph_manager, spec.decode_cudagraph_manager):
        desc = m.dispatch(3, 3, 1)
        assert desc.cg_mode == CUDAGraphMode.NONE and desc.num_tokens == 3
    vocab = h.vllm_config.model_config.get_vocab_size()
    for pos in range(K):
        spec.sample_draft(torch.randn(n, vocab), None, torch.arange(n), None,
                          None, torch.tensor(pos), None)
    for m in (spec.prefill_cudagraph_manager, spec.decode_cudagraph_manager):
        assert m.dispatch(3, 3, 1).cg_mode == CUDAGraphMode.FULL
    assert gd.stats(spec)["v2_eager_steps"] == 1


def test_v2_status_line(patched, monkeypatch):
    """`vllm-patch status` has a Model Runner V2 line: on when patched
    (the patches of the other vLLM series count as not needed), off in the
    stock run."""
    monkeypatch.delenv("VLLM_PATCH_MASKED_DRAFTS", raising=False)
    monkeypatch.delenv("VLLM_PATCH_FORCED_DRAFTS", raising=False)
    from vllm_patch import envs
    from vllm_patch.v1.worker.gpu.spec_decode import speculator as v2

    (row,) = v2.feature_status(envs.settings())
    assert row["feature"] == "Model Runner V2"
    assert row["status"] == ("on" if patched else "off"), row
    applied = [n for n, o in REGISTRY.outcomes.items()
               if n.startswith("v2-grammar-drafts-") and o.state is State.APPLIED]
    assert len(applied) == (3 if patched else 0), applied
