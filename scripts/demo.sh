#!/usr/bin/env bash
# The main job on a fresh machine: set up (idempotent), print the guarantee
# table for the installed vLLM, then `vllm-patch demo`: build the tiny local
# model, launch a local P/D deployment on Ray (prefill + decode vLLM servers,
# spec decode, structured outputs) stock and then patched, send both the same
# structured workload and print the side-by-side table. Extra arguments go to
# `vllm-patch demo` (e.g. --requests 16).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh"
venv="${VLLM_PATCH_VENV:-$repo/.venv}"
"$venv/bin/vllm-patch" status
exec "$venv/bin/vllm-patch" demo "$@"
