"""Ray-based P/D launcher (`vllm-patch launch`) and the demo (`vllm-patch demo`).

Ray places and supervises; each instance is a real vLLM OpenAI server
process started by a Ray actor on its node (vllm_patch.launch.supervisor),
the router (vllm_patch.launch.router) runs in the launching process."""
