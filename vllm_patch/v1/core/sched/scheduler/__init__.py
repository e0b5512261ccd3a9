"""Patches of vllm.v1.core.sched.scheduler, one file per guarantee."""
