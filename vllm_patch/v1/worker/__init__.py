"""Patches for vllm.v1.worker (see the modules)."""
