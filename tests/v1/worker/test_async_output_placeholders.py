"""Under async scheduling the V1 runner keeps a placeholder (-1) in a
request's output list for each token it has not seen, and fills them in only
in steps where some request of the batch needs output tokens (penalties, bad
words). When such a request joins, stock `update_async_output_token_ids`
takes every old placeholder of the other requests for the previous step's
and cuts their lists down to that step's tokens: the runner loses count of
their outputs, and near max_model_len the engine core dies on "Sampled token
IDs exceed the max model length" (found by the production-mix soak with
EAGLE and async scheduling). The input batch's state is given here as it is
after such a step; the function is vLLM's (patched or stock)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.unit


def _batch(lists, sampled, prev_drafts):
    from vllm_patch.v1.worker.gpu_input_batch import PREV_DRAFTS_ATTR

    batch = SimpleNamespace(
        sampling_metadata=SimpleNamespace(output_token_ids=lists),
        sampled_token_ids_cpu=torch.tensor(sampled),
        prev_req_id_to_index={f"r{i}": i for i in range(len(lists))},
        req_ids=[f"r{i}" for i in range(len(lists))],
        async_copy_ready_event=SimpleNamespace(synchronize=lambda: None),
    )
    # What the runner's _sample hands over (ignored by stock vLLM).
    batch.__dict__[PREV_DRAFTS_ATTR] = prev_drafts
    return batch


def _update(batch):
    from vllm.v1.worker.gpu_input_batch import InputBatch

    InputBatch.update_async_output_token_ids(batch)


def test_unfilled_placeholders_keep_their_count(patched):
    # r0 ran 37 steps beside unpenalised requests: nothing was filled in. Its
    # previous step verified 3 drafts and accepted 1 (2 tokens sampled).
    # r1 is penalised: its lists were filled in every step.
    r0 = [-1] * 37
    r1 = [5, 6, 7, -1, -1, -1, -1]
    batch = _batch([r0, r1], [[11, 12, -1, -1], [8, 9, 10, 13]],
                   np.array([3, 3]))
    _update(batch)
    assert r1 == [5, 6, 7, 8, 9, 10, 13]  # the case stock handles
    if not patched:
        assert r0 == [11, 12]  # 37 placeholders for 4 of the previous step
        return
    assert len(r0) == 37 - 4 + 2
    assert r0[-2:] == [11, 12] and set(r0[:-2]) == {-1}


def test_rejected_drafts_shrink_the_list(patched):
    # Filled-in history, previous step: 2 drafts verified, none accepted.
    r0 = [3, 4, -1, -1, -1]
    _update(_batch([r0], [[7, -1, -1]], np.array([2])))
    assert r0 == [3, 4, 7]


def test_without_speculative_decoding(patched):
    # Async scheduling, no drafts: one placeholder per step; the runner hands
    # over no draft counts (None) and the row has one token.
    r0 = [-1] * 10
    _update(_batch([r0], [[42]], None))
    if not patched:
        assert r0 == [42]
        return
    assert r0 == [-1] * 9 + [42]


def test_token_count_realigned_after_rejected_drafts(patched):
    """The runner's token count must come back to the scheduler's after a
    step that removed rejected drafts' placeholders from the output list
    (figures from a soak trace: prompt 387, max_model_len 512)."""
    from vllm_patch.v1.worker.gpu_model_runner.async_output_count_align import align_token_counts

    prompt, max_model_len = 387, 512
    # After _update_states: the list has the scheduler's 122 outputs (the
    # last 2 + 1 are the previous step's placeholders: 2 drafts verified).
    r0 = [9] * 119 + [-1, -1, -1]
    count = np.array([509])
    # The penalised neighbour makes the runner fill in the placeholders:
    # both drafts were rejected, 1 token sampled.
    _update(_batch([r0], [[4, -1, -1]], np.array([2])))
    assert len(r0) == 120
    count[0] += 1  # _bookkeeping_sync: this step's sampled token
    r0.append(-1)
    # Next step: the scheduler knows the rejection: 123 outputs, 1 draft.
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_id_to_index={"r0": 0},
                                    num_tokens_no_spec=count,
                                    num_prompt_tokens=np.array([prompt])),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1))
    scheduled = SimpleNamespace(req_ids=["r0"], num_output_tokens=[123])
    # Stock aligns only when the list is longer than the scheduler's count.
    assert not 123 < len(r0) + 1
    if patched:
        assert align_token_counts(runner, scheduled) == 0  # not ahead yet
    # Two more such steps (1 draft each, rejected) and the count is ahead.
    for nout in (123, 124):
        count[0] += 1
        if patched:
            align_token_counts(runner, SimpleNamespace(req_ids=["r0"],
                                                       num_output_tokens=[nout]))
    final = int(count[0]) + 1  # the last step's sampled token
    if not patched:
        assert final > max_model_len  # "Sampled token IDs exceed ..."
        return
    assert final <= max_model_len
