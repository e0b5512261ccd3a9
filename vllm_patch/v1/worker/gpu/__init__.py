"""Patches for vllm.v1.worker.gpu (Model Runner V2; see the modules)."""
