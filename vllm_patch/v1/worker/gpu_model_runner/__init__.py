"""Patches of vllm.v1.worker.gpu_model_runner (the V1 model runner: the one
vLLM's CPU build always uses, and the CUDA build's fallback), one file each:

- `g3_drafts`: G3 on this runner (drafts at or after the first unacceptable
  position are rejected; no drafts proposed or handed over after a
  grammar's end);
- `async_output_placeholders`: the runner's half of the async-scheduling
  placeholder fix (`async-output-placeholders-step`);
- `async_output_count_align`: the runner's token count never stays ahead of
  the scheduler's (`async-output-count-align`);
- `forced_drafts`: the grammar's forced continuation as the drafts of
  ngram and suffix decoding for structured requests
  (`grammar-drafts-forced-model-free`);
- `cpu_seeded_prefill_rewind`: seeded requests with a prompt prefilled in
  several steps on vLLM's CPU build (`cpu-seeded-prefill-rewind`).
"""
