#!/usr/bin/env bash
# The main job on a fresh machine: set up, build the tiny local model, print
# the guarantee table for the installed vLLM, then run the package's own
# conformance scenarios stock and patched (`vllm-patch verify`).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh"
venv="${VLLM_PATCH_VENV:-$repo/.venv}"
"$venv/bin/vllm-patch" build-model
"$venv/bin/vllm-patch" status
exec "$venv/bin/vllm-patch" verify "$@"
