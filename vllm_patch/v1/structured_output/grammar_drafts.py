"""Grammar-aware drafting, scheduler side: the worker finds the scheduler's
structured-output backend.

When the worker runs in the engine-core process (the in-process executor,
one worker), the drafter compiles its shadow grammars with the scheduler's
own backend (same tokenizer info, same compile cache). Nothing in vLLM links
the worker to the scheduler, so each StructuredOutputManager puts itself in
`vllm_patch.v1.spec_decode.grammar_drafts.MANAGERS` (a weak set) when it is
built. Multiprocess workers (the OpenAI server) find none there and build
their own manager (taken out of the set again). See that module for the
feature.
"""

from __future__ import annotations

from typing import Any

from vllm_patch.patching import Patch


def _make_init(original: Any) -> Any:
    def __init__(self: Any, vllm_config: Any) -> None:
        original(self, vllm_config)
        from vllm_patch.v1.spec_decode.grammar_drafts import MANAGERS

        MANAGERS.add(self)

    return __init__


PATCHES: list[Patch] = [
    Patch(
        name="grammar-drafts-find-backend",
        guarantee="package",
        target="vllm.v1.structured_output:StructuredOutputManager.__init__",
        versions=("0.32", "0.33"),
        signature=("self", "vllm_config"),
        make=_make_init,
        why=("grammar-aware drafting compiles a shadow grammar per structured "
             "request with the scheduler's backend; the worker has no link "
             "to the scheduler"),
        how=("each StructuredOutputManager registers itself in a weak set "
             "the drafter reads (the one built from the same vllm_config)"),
        upstream="none (vLLM PR #47885 keeps the matcher in the scheduler)",
        remove_when="with the grammar-drafts-* proposer patches",
    ),
]
