"""The G2 scheduler patch finds `StructuredOutputManager.accept_tokens` the
way stock `update_from_output` calls it: on the manager instance. A manager
that provides its own `accept_tokens` (vLLM's own scheduler tests use a Mock
manager; a wrapper set on one instance) must neither crash the patch nor have
its grammar walked twice.

The first test is the equivalent of vLLM's
tests/v1/core/test_scheduler.py::test_abort_request_when_structured_output_fsm_cannot_advance
(and its AsyncScheduler twin): a bare scheduler whose Mock manager's
`accept_tokens` returns False must finish the request with an error. Looking
the method up on the manager's class raised AttributeError inside the patch.
"""

from __future__ import annotations

from unittest.mock import Mock

import pytest

from vllm_patch.testing.harness import Harness

# These test the plugin's G2 code (skipped on a build carrying G2).
pytestmark = [pytest.mark.scheduler, pytest.mark.usefixtures("plugin_g2")]


def _bare_scheduler(cls):
    """vLLM's test double: a scheduler built with object.__new__ and Mock
    collaborators, the manager's accept_tokens an instance attribute."""
    from vllm.v1.structured_output import StructuredOutputGrammar

    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    scheduler = object.__new__(cls)
    params = SamplingParams(ignore_eos=True, max_tokens=4)
    params.update_from_generation_config({}, 1)
    request = Request(request_id="0", prompt_token_ids=[0, 1],
                      mm_features=None, sampling_params=params,
                      pooling_params=None)
    request.structured_output_request = Mock()
    request.structured_output_request.grammar = Mock(
        spec=StructuredOutputGrammar)
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = request.num_tokens
    if cls.__name__ == "AsyncScheduler":
        request.num_output_placeholders = 1

    for name, value in dict(
            perf_metrics=None, connector=None, ec_connector=None,
            aux_output_connector=None, waiting=Mock(),
            kv_cache_manager=Mock(), kv_event_publisher=Mock(),
            finished_req_ids=set(), finished_req_ids_dict=None,
            grammar_compile_error_reqs=set(),
            encoder_cache_mismatch_reqs=set(), vllm_config=Mock(),
            return_sampling_mask=False, recompute_kv_load_failures=False,
            defer_block_free=False, num_spec_tokens=0,
            make_stats=Mock(return_value=None),
            max_model_len=128).items():
        setattr(scheduler, name, value)
    scheduler.kv_cache_manager.take_events.return_value = None
    scheduler.kv_cache_manager.estimate_cached_tokens.return_value = 0
    scheduler.structured_output_manager = Mock()
    scheduler.structured_output_manager.accept_tokens.return_value = False
    scheduler.requests = {request.request_id: request}
    scheduler.running = [request]

    def free_request(req, delay_free_blocks=False):
        scheduler.finished_req_ids.add(req.request_id)
        scheduler.requests.pop(req.request_id, None)
        return None, None

    scheduler._free_request = Mock(side_effect=free_request)
    return scheduler, request


@pytest.mark.parametrize("kind", ["Scheduler", "AsyncScheduler"])
def test_manager_with_instance_accept_tokens(kind):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import FinishReason
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    cls = Scheduler if kind == "Scheduler" else AsyncScheduler
    scheduler, request = _bare_scheduler(cls)
    rid = request.request_id
    output = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={rid: 1}, total_num_scheduled_tokens=1,
        scheduled_encoder_inputs={}, scheduled_spec_decode_tokens={},
        finished_req_ids=set(), free_encoder_mm_hashes=[])
    runner = ModelRunnerOutput(req_ids=[rid], req_id_to_index={rid: 0},
                               sampled_token_ids=[[123]], logprobs=None,
                               prompt_logprobs_dict={}, pooler_output=[])

    outputs = scheduler.update_from_output(output, runner)

    scheduler.structured_output_manager.accept_tokens.assert_called_once_with(
        request, [123])
    assert request.resumable is False
    assert request.status == RequestStatus.FINISHED_ERROR
    assert rid not in scheduler.requests and not scheduler.running
    scheduler._free_request.assert_called_once_with(request)
    (out,) = outputs[0].outputs
    assert out.request_id == rid and out.finish_reason == FinishReason.ERROR


def test_instance_accept_tokens_walks_the_grammar_once(patched):
    """A real manager whose instance carries its own accept_tokens (here one
    that walks the grammar itself and records the call): the patch must see
    that method, not the class's, so the grammar is walked once per token.
    Looked up on the class, the patch advanced the grammar and the
    instance's accept_tokens advanced it again: 'a' twice for the regex
    'ab', a rejected token, the request finished with an error."""
    h = Harness(backend="xgrammar")
    manager = h.scheduler.structured_output_manager
    calls: list[list[int]] = []

    def accept_tokens(request, new_token_ids):
        calls.append(list(new_token_ids))
        grammar = request.structured_output_request.grammar
        return grammar.accept_tokens(request.request_id, new_token_ids)

    manager.accept_tokens = accept_tokens
    rid = h.add_request([70, 71], regex="ab", ignore_eos=True, max_tokens=4)
    a, b = h.tok("a"), h.tok("b")
    h.step({rid: [a]})
    h.step({rid: [b]})
    emitted = h.emitted(rid)
    assert calls == [[a], [b]]
    assert emitted.token_ids == [a, b]
    assert emitted.finish_reason != "error"
    assert h.grammar(rid).num_processed_tokens == 2
