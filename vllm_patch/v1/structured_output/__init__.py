"""Patches of vllm.v1.structured_output, one file per guarantee."""
