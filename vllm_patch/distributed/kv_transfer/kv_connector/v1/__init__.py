"""Patches of vllm.distributed.kv_transfer.kv_connector.v1."""
