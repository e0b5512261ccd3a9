"""Tiny local models for tests, benchmarks and the demo (no network).

`build_target()` writes a byte-level BPE tokenizer (trained with `tokenizers`
on synthetic JSON, a few hundred tokens) and a 2-layer Llama (head size 32,
the smallest the CPU attention backend accepts) into a cache folder and
returns its path. The same checkpoint serves as `draft_model`: with greedy
sampling a draft equal to the target is accepted ~100 %, so multi-token steps
cross a grammar's end.

Deterministic (fixed seeds), cached by a key of the build parameters, built
atomically (temp dir + rename) under a file lock so parallel test processes
share one build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

BUILDER_VERSION = 1

# Special tokens, in id order. `<|im_end|>` is a generation-config EOS (as in
# chat models); `<think>`/`</think>` let vLLM's deepseek_r1 reasoning parser run.
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|im_end|>", "<think>", "</think>"]
BOS, EOS, PAD, IM_END, THINK, END_THINK = range(len(SPECIAL_TOKENS))

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

TARGET_CONFIG = dict(
    vocab_target=400,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    seed=0,
)


def cache_root() -> Path:
    root = os.environ.get("VLLM_PATCH_MODEL_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "vllm-patch" / "models"
    base.mkdir(parents=True, exist_ok=True)
    return base


def _key(name: str, params: dict) -> str:
    blob = json.dumps({"v": BUILDER_VERSION, "name": name, **params}, sort_keys=True)
    return f"{name}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def cached_build(name: str, params: dict, build: Callable[[Path], None]) -> Path:
    """Return the cached folder for (name, params), building it once."""
    final = cache_root() / _key(name, params)
    done = final / ".complete"
    if done.exists():
        return final
    with _locked(final):
        if done.exists():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
        try:
            build(tmp)
            (tmp / ".complete").write_text(json.dumps(params, sort_keys=True))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _corpus(seed: int, lines: int = 6000) -> list[str]:
    rng = random.Random(seed)
    names = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
    cities = ["paris", "tokyo", "lima", "oslo", "cairo", "delhi", "quito"]
    words = ["yes", "no", "true", "false", "null", "red", "green", "blue",
             "id", "name", "age", "city", "ok", "items", "tool", "args"]
    out = []
    for _ in range(lines):
        kind = rng.random()
        if kind < 0.6:
            obj = {"name": rng.choice(names), "age": rng.randint(0, 99),
                   "ok": rng.random() < 0.5, "city": rng.choice(cities)}
            if rng.random() < 0.3:
                obj["items"] = [rng.randint(0, 9) for _ in range(rng.randint(0, 4))]
            sep = (",", ":") if rng.random() < 0.7 else (", ", ": ")
            out.append(json.dumps(obj, separators=sep))
        elif kind < 0.8:
            out.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))))
        else:
            out.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789-_.")
                               for _ in range(rng.randint(4, 20))))
    return out


def _build_tokenizer(out: Path, vocab_target: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _build_llama(out: Path, vocab_size: int, p: dict, **extra) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(p["seed"])
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=p["hidden_size"],
        intermediate_size=p["intermediate_size"],
        num_hidden_layers=p["num_hidden_layers"],
        num_attention_heads=p["num_attention_heads"],
        num_key_value_heads=p["num_key_value_heads"],
        max_position_embeddings=p["max_position_embeddings"],
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **extra,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=BOS, eos_token_id=[EOS, IM_END],
                     pad_token_id=PAD).save_pretrained(str(out))


def build_target() -> Path:
    """The tiny target model (also the draft for `draft_model`)."""
    params = dict(TARGET_CONFIG)

    def build(out: Path) -> None:
        _build_tokenizer(out, params["vocab_target"], params["seed"])
        from transformers import AutoTokenizer

        vocab_size = len(AutoTokenizer.from_pretrained(str(out)))
        _build_llama(out, vocab_size, params)

    return cached_build("tiny-llama", params, build)


if __name__ == "__main__":
    print(build_target())
