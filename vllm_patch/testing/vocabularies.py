"""Real vocabularies for tests and benchmarks, through vLLM's own classes.

`mistral_common` (a vLLM dependency) ships two real tokenizers:
`tekken_240911.json` (131,072 tokens, byte-level BPE) and
`mistral_instruct_tokenizer_240323.model.v3` (32,768, SentencePiece).
vLLM's `MistralTokenizer` wraps them as a model's tokenizer, and its
structured-output backends take them (guidance only the Tekken one). The
tiny world's 8,192-token BPE is there once built
(`python -m vllm_patch.testing.tiny_world`).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

FILES = {"tekken": "tekken_240911.json",
         "spm": "mistral_instruct_tokenizer_240323.model.v3"}


def mistral_data() -> Path:
    import mistral_common

    return Path(mistral_common.__file__).parent / "data"


@lru_cache(maxsize=None)
def load_tokenizer(name: str) -> Any:
    """vLLM's tokenizer object: "tekken", "spm" or "tiny" (None when the
    tiny world is not built)."""
    if name in FILES:
        from transformers.tokenization_mistral_common import MistralCommonBackend
        from vllm.tokenizers.mistral import MistralTokenizer

        return MistralTokenizer(MistralCommonBackend(
            str(mistral_data() / FILES[name]), mode="test"))
    if name == "tiny":
        from vllm.tokenizers import get_tokenizer

        from vllm_patch.testing.tiny_world import cached_world

        world = cached_world(need=())
        return None if world is None else get_tokenizer(str(world["tokenizer"]))
    raise ValueError(f"unknown vocabulary {name!r}")


def vocab_size(tokenizer: Any) -> int:
    """The vocabulary size vLLM's backends are built with."""
    vocab = getattr(tokenizer, "vocab", None)
    if isinstance(vocab, list):
        return len(vocab)  # MistralTokenizer, as the xgrammar backend sizes it
    return max(len(tokenizer), int(getattr(tokenizer, "vocab_size", 0)))


def make_backend(kind: str, tokenizer: Any, whitespace: str = "flexible") -> Any:
    """vLLM's structured-output backend ("xgrammar", "guidance") for this
    tokenizer, as StructuredOutputManager builds it (the config fields the
    backends read; whitespace "none" is disable_any_whitespace=True)."""
    so = SimpleNamespace(disable_any_whitespace=whitespace == "none",
                         disable_additional_properties=False,
                         reasoning_parser="")
    config = SimpleNamespace(structured_outputs_config=so, model_config=None,
                             speculative_config=None)
    if kind == "xgrammar":
        from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend as cls
    elif kind == "guidance":
        from vllm.v1.structured_output.backend_guidance import GuidanceBackend as cls
    else:
        raise ValueError(f"unknown backend {kind!r}")
    return cls(config, tokenizer, vocab_size(tokenizer))


def json_grammar(backend: Any, schema: Any) -> Any:
    """A vLLM grammar object for a JSON schema (dict or str)."""
    import json

    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    spec = schema if isinstance(schema, str) else json.dumps(schema)
    return backend.compile_grammar(StructuredOutputOptions.JSON, spec)
