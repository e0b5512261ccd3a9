"""Fix for vllm.distributed.kv_transfer.kv_connector.v1.example_connector: a
one-token prompt makes ExampleConnector report a negative number of external
tokens (production fix, on by default; not a G1-G4 guarantee).

`ExampleConnector.get_num_new_matched_tokens` answers
`align_to_block_size(len(prompt) - 1, block_size) - num_computed_tokens`, and
`align_to_block_size(n)` is `(n - 1) // block_size * block_size`: for a
one-token prompt that is `(0 - 1) // B * B = -B`. The lookup itself hashes
`prompt[:-B]`, the empty list, whose folder exists as soon as any prompt of
at most B tokens was saved (its stored part is empty too). So a one-token
prompt "hits" and the scheduler is told -B external tokens:
num_computed_tokens = -B (-128 for B=128), and the model runner's
`_prepare_inputs` indexes out of range (IndexError), which kills the engine.
The replacement never reports fewer than 0 tokens to load: nothing to load.
"""

from __future__ import annotations

from typing import Any, Callable

from vllm_patch.patching import Patch


def _make_matched(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        count, load_async = original(self, request, num_computed_tokens)
        if count is not None and count < 0:
            return 0, False
        return count, load_async

    return get_num_new_matched_tokens


PATCHES: list[Patch] = [
    Patch(
        name="example-connector-short-prompt",
        guarantee="package",
        target="vllm.distributed.kv_transfer.kv_connector.v1.example_connector:"
               "ExampleConnector.get_num_new_matched_tokens",
        versions=("0.32", "0.33"),
        signature=("self", "request", "num_computed_tokens"),
        make=_make_matched,
        why=("for a one-token prompt ExampleConnector reports "
             "align_to_block_size(0) = -block_size external tokens once any "
             "short prompt was saved: num_computed_tokens becomes negative "
             "and the model runner's _prepare_inputs raises IndexError, "
             "killing the engine (P/D prefill server)"),
        how=("wraps get_num_new_matched_tokens: a negative count becomes 0 "
             "(nothing to load)"),
        upstream="none yet (vLLM example_connector.py align_to_block_size("
                 "len(token_ids) - 1))",
        remove_when="ExampleConnector never reports a negative token count",
    ),
]
