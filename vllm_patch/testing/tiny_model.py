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



# EAGLE-1 head for the tiny target (vLLM `speculative_config={"method":
# "eagle"}`). vLLM 0.32.0 wraps a draft LlamaConfig in EAGLEConfig, which
# renames LlamaForCausalLM -> EagleLlamaForCausalLM
# (model_executor/models/llama_eagle.py): embed(token_{p+1}) ++ target
# hidden h_p -> fc (2H -> H, no bias) -> decoder layers (layer 0 without
# input_layernorm) -> hidden + residual, no final norm; embed_tokens and
# lm_head are shared with the target when the checkpoint has none. Checkpoint
# keys therefore are `fc.weight` and `layers.N.*` only. The draft at index p
# uses the target position p (llm_base_proposer.py: positions unshifted).
EAGLE_CONFIG = dict(
    num_hidden_layers=1,
    seed=0,
    # distillation (trained=True only)
    num_sequences=256,
    seq_len=48,
    steps=300,
    batch=32,
    lr=3e-3,
    feature_weight=1.0,
)


class _EagleHead:
    """A torch re-implementation of vLLM's EagleLlamaForCausalLM forward,
    with HF/vLLM checkpoint names, for training on the CPU."""

    @staticmethod
    def build(cfg, num_layers: int):
        import torch
        from torch import nn

        H, I = cfg.hidden_size, cfg.intermediate_size
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        theta = cfg.rope_parameters["rope_theta"]

        class RMSNorm(nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = nn.Parameter(torch.ones(H))

            def forward(self, x):
                var = x.pow(2).mean(-1, keepdim=True)
                return self.weight * (x * torch.rsqrt(var + eps))

        def rope(x, pos):
            inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
            ang = pos[..., None].float() * inv  # (B, T, hd/2)
            cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
            sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
            x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
            return x * cos + torch.cat([-x2, x1], -1) * sin

        class Attn(nn.Module):
            def __init__(self):
                super().__init__()
                self.q_proj = nn.Linear(H, nh * hd, bias=False)
                self.k_proj = nn.Linear(H, nkv * hd, bias=False)
                self.v_proj = nn.Linear(H, nkv * hd, bias=False)
                self.o_proj = nn.Linear(nh * hd, H, bias=False)

            def forward(self, x, pos):
                B, T, _ = x.shape
                q = self.q_proj(x).view(B, T, nh, hd).transpose(1, 2)
                k = self.k_proj(x).view(B, T, nkv, hd).transpose(1, 2)
                v = self.v_proj(x).view(B, T, nkv, hd).transpose(1, 2)
                q, k = rope(q, pos), rope(k, pos)
                if nkv != nh:
                    k = k.repeat_interleave(nh // nkv, 1)
                    v = v.repeat_interleave(nh // nkv, 1)
                o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                return self.o_proj(o.transpose(1, 2).reshape(B, T, nh * hd))

        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.gate_proj = nn.Linear(H, I, bias=False)
                self.up_proj = nn.Linear(H, I, bias=False)
                self.down_proj = nn.Linear(I, H, bias=False)

            def forward(self, x):
                return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

        class Layer(nn.Module):
            def __init__(self, first: bool):
                super().__init__()
                if not first:
                    self.input_layernorm = RMSNorm()
                self.self_attn = Attn()
                self.post_attention_layernorm = RMSNorm()
                self.mlp = MLP()

            def forward(self, x, pos):
                # vLLM LlamaDecoderLayer with fused add+norm, as a plain
                # pre-norm residual block (layer 0: no input_layernorm).
                h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
                x = x + self.self_attn(h, pos)
                return x + self.mlp(self.post_attention_layernorm(x))

        class Head(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(2 * H, H, bias=False)
                self.layers = nn.ModuleList(Layer(i == 0) for i in range(num_layers))

            def forward(self, embeds, hidden, pos):
                x = self.fc(torch.cat([embeds, hidden], -1))
                for layer in self.layers:
                    x = layer(x, pos)
                return x

        return Head()


def _eagle_distil(head, target_dir: Path, p: dict) -> dict:
    """Distil the target's greedy next token into the head (teacher forcing
    on the target's own greedy continuations of corpus prefixes)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    target = LlamaForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(p["seed"])
    T = p["seq_len"]
    lines = [tok(line)["input_ids"] for line in _corpus(p["seed"] + 1, 4 * p["num_sequences"])]
    seqs = []
    with torch.no_grad():
        lengths = list(range(2, 18))
        per = p["num_sequences"] // len(lengths)
        for k in lengths:
            pool = [ids[:k] for ids in lines if len(ids) >= k]
            idx = torch.randperm(len(pool), generator=gen)[:per].tolist()
            x = torch.tensor([pool[i] for i in idx])
            out = target(input_ids=x, use_cache=True)
            while x.shape[1] < T:  # greedy continuation with the KV cache
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                x = torch.cat([x, nxt], 1)
                out = target(input_ids=nxt, past_key_values=out.past_key_values,
                             use_cache=True)
            seqs.append(x)
        ids = torch.cat(seqs)
        out = target.model(input_ids=ids)
        hidden = out.last_hidden_state  # post-norm, as vLLM hands to EAGLE
        greedy = target.lm_head(hidden).argmax(-1)
    embed = target.model.embed_tokens.weight.detach()
    lm_head = target.lm_head.weight.detach()
    n = ids.shape[0]
    n_train = n - n // 8
    pos = torch.arange(T - 1)[None]

    def batch_loss(rows):
        tokens = ids[rows, 1:]                  # token_{p+1}
        h = hidden[rows, :-1]                   # h_p
        o = head(embed[tokens], h, pos.expand(len(rows), -1))
        logits = o @ lm_head.T
        labels = greedy[rows, 1:]               # target's argmax at p+1
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                               labels.reshape(-1))
        feat = torch.nn.functional.smooth_l1_loss(o, hidden[rows, 1:])
        top1 = (logits.argmax(-1) == labels).float().mean().item()
        return ce + p["feature_weight"] * feat, top1

    opt = torch.optim.AdamW(head.parameters(), lr=p["lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, p["steps"])
    for _ in range(p["steps"]):
        rows = torch.randint(0, n_train, (p["batch"],), generator=gen)
        loss, _ = batch_loss(rows)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        _, held_out = batch_loss(torch.arange(n_train, n))
    return {"held_out_top1": round(held_out, 4)}


def build_eagle(trained: bool) -> Path:
    """An EAGLE-1 head for `build_target()`: random weights, or briefly
    distilled from the target (~1 min on 2 cores). Pass the path as
    `speculative_config={"method": "eagle", "model": path, ...}`."""
    target_dir = build_target()
    params = {k: v for k, v in EAGLE_CONFIG.items()
              if trained or k in ("num_hidden_layers", "seed")}
    params.update(trained=trained, target=target_dir.name)

    def build(out: Path) -> None:
        import torch
        from safetensors.torch import save_file
        from transformers import LlamaConfig

        torch.manual_seed(params["seed"])
        cfg = LlamaConfig.from_pretrained(str(target_dir))
        cfg.num_hidden_layers = params["num_hidden_layers"]
        cfg.architectures = ["LlamaForCausalLM"]  # vLLM: -> EagleLlamaForCausalLM
        head = _EagleHead.build(cfg, params["num_hidden_layers"])
        for name, param in head.named_parameters():
            if name.endswith("layernorm.weight"):
                torch.nn.init.ones_(param)
            else:
                torch.nn.init.normal_(param, std=cfg.initializer_range)
        info = {}
        if trained:
            info = _eagle_distil(head, target_dir, params)
        state = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
        save_file(state, str(out / "model.safetensors"))
        cfg.save_pretrained(str(out))
        for f in target_dir.iterdir():  # tokenizer files, generation config
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template",
                                  "generation_config")):
                shutil.copy(f, out / f.name)
        (out / "eagle_build.json").write_text(json.dumps({**params, **info}, indent=1))

    return cached_build("tiny-eagle", params, build)


if __name__ == "__main__":
    print(build_target())
    print(build_eagle(trained=False))
    print(build_eagle(trained=True))
