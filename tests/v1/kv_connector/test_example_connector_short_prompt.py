"""vLLM's ExampleConnector and a one-token prompt: once any short prompt was
saved (its stored part is the empty token list), a one-token prompt "hits"
that empty entry and `get_num_new_matched_tokens` answers
align_to_block_size(0) = -block_size. The real scheduler then sets
num_computed_tokens = -block_size (the model runner's `_prepare_inputs`
raises IndexError on it: the P/D prefill server dies). Patched: nothing to
load, the one token is computed locally."""

from __future__ import annotations

import pytest

from vllm_patch.testing.harness import Harness

pytestmark = pytest.mark.scheduler

BLOCK = 4


def test_one_token_prompt(tmp_path, patched, native):
    from vllm.config import KVTransferConfig

    cfg = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                           kv_connector_extra_config={
                               "shared_storage_path": str(tmp_path)})
    h = Harness(kv_transfer_config=cfg, block_size=BLOCK)
    conn = h.scheduler.connector
    # What a saved prompt of <= block_size tokens leaves in the storage: the
    # folder of its stored part, the empty token list.
    import torch
    conn._generate_foldername_debug(torch.tensor([], dtype=torch.int64), [],
                                    create_folder=True)
    rid = h.add_request([70], max_tokens=2)
    so = h.schedule()
    req = h.request(rid)
    if patched or "example-connector-short-prompt" in native:
        assert so.num_scheduled_tokens[rid] == 1
        assert req.num_computed_tokens == 1
    else:
        # Stock: -block_size external tokens, so 1 + block_size tokens
        # scheduled for a one-token prompt, from position -block_size.
        assert so.num_scheduled_tokens[rid] == 1 + BLOCK
