"""The tiny world (vllm_patch.testing.tiny_world) has the promised shape, and
the grammar spec-decode benchmark's command line is clear. Building the world
takes minutes, so it never happens here: the checks of the built folders skip
when it is absent (build it with `python -m vllm_patch.testing.tiny_world`)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_patch.testing import tiny_world

# A package feature (test tooling): nothing here depends on the patches.
pytestmark = [pytest.mark.unit, pytest.mark.patched_only]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "grammar_spec_decode.py"


def _bench():
    spec = importlib.util.spec_from_file_location("grammar_spec_decode", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _head_size(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def test_builder_parameters_promise_a_realistic_world():
    assert tiny_world.WORLD_CONFIG["vocab_target"] >= 8192
    t, d = tiny_world.TARGET_CONFIG, tiny_world.DRAFT_CONFIG
    assert _head_size(t) >= 32 and _head_size(d) >= 32
    assert d["num_hidden_layers"] < t["num_hidden_layers"]
    assert d["hidden_size"] <= t["hidden_size"]


@pytest.fixture(scope="module")
def world():
    w = tiny_world.cached_world()
    if w is None:
        pytest.skip("the tiny world is not built (python -m vllm_patch.testing.tiny_world, "
                    "about 15 minutes): nothing to inspect")
    return w


def _vocab(folder: Path) -> int:
    tok = json.loads((folder / "tokenizer.json").read_text())
    return len(tok["model"]["vocab"]) + sum(
        a["id"] >= len(tok["model"]["vocab"]) for a in tok["added_tokens"])


def test_built_world_has_the_promised_shape(world):
    cfg = {k: json.loads((world[k] / "config.json").read_text())
           for k in ("target", "draft", "eagle")}
    vocab = _vocab(world["tokenizer"])
    assert vocab >= 8192
    assert cfg["target"]["vocab_size"] == vocab == cfg["draft"]["vocab_size"]
    assert _head_size(cfg["target"]) >= 32 and _head_size(cfg["draft"]) >= 32
    assert cfg["draft"]["num_hidden_layers"] < cfg["target"]["num_hidden_layers"]
    # EAGLE-1 head: the target's width, one decoder layer, weights present
    assert cfg["eagle"]["hidden_size"] == cfg["target"]["hidden_size"]
    assert cfg["eagle"]["num_hidden_layers"] == 1
    for k in ("target", "draft", "eagle"):
        assert (world[k] / "model.safetensors").stat().st_size > 0
    build = json.loads((world["target"] / "world_build.json").read_text())
    assert build["train_tokens"] > 0 and build["json_sequences"] > 0


def test_prompts_carry_schema_and_chat_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = tiny_world.prompt_for_schema(schema)
    assert p.startswith("user: ") and p.endswith("\nassistant: ")
    assert tiny_world.compact(schema) in p


def test_benchmark_help_names_modes_and_drafters():
    out = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for word in ("--schemas", "--quick", "--k", "--drafters", "draft,eagle,perfect",
                 "stock,without,with", "tiny_world"):
        assert word in out.stdout, word


@pytest.mark.parametrize("argv, message", [
    (["--drafters", "medusa"], "--drafters: unknown ['medusa']; choose from draft,eagle,perfect"),
    (["--modes", "fast"], "--modes: unknown ['fast']; choose from stock,without,with"),
    (["--k", "0"], "--k must be positive, got 0"),
    (["--schemas", "-3"], "--schemas must be positive, got -3"),
    (["--timeout", "0"], "--timeout must be positive"),
])
def test_benchmark_argument_errors_are_clear(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _bench().parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_benchmark_quick_is_small():
    a = _bench().parse_args(["--quick"])
    assert a.schemas <= 3 and a.drafters == ["perfect"]
    assert a.modes == ["stock", "without", "with"]
