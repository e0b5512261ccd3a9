"""Patches of vllm.v1.metrics.stats, one file per guarantee."""
