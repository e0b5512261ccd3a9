"""Scheduler test harness: the real vLLM v1 scheduler, fake model outputs.

Everything is real except the model runner: a `VllmConfig` built from the tiny
local model (`tiny_model.build_target()`), the real `Scheduler` /
`AsyncScheduler`, the real `StructuredOutputManager` with a real grammar
backend (xgrammar, guidance, outlines), the real reasoning parser, KV cache
manager, block pool and prefix cache. The test decides what the "GPU" sampled
(tokens, drafts, logprobs) and the harness feeds it through
`update_from_output` exactly as `EngineCore.step` / `step_with_batch_queue`
do. Works unchanged on vLLM 0.32 and 0.33.

Tiny tokenizer ids: 0 <s>, 1 </s> (tokenizer EOS), 2 <pad>, 3 <|im_end|>
(generation-config EOS), 4 <think>, 5 </think>; `tok("a")` gives the id of a
string (byte-level BPE: every string encodes).

Typical use::

    h = Harness(backend="xgrammar", num_spec_tokens=3)
    rid = h.add_request([70, 71], regex="ab", ignore_eos=True)
    h.step({rid: [h.tok("a")]})                       # prefill, samples 'a'
    h.set_drafts({rid: [h.tok("b"), EOS, h.tok("c")]})
    h.step({rid: [h.tok("b"), EOS, h.tok("c")]})
    h.emitted(rid).token_ids                             # what the client saw
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_patch.testing import tiny_model

BOS, EOS, PAD, IM_END, THINK, END_THINK = range(6)


@dataclass
class Emitted:
    """Everything the engine sent to the client for one request."""

    token_ids: list[int] = field(default_factory=list)
    # One logprob row per emitted token (sampled token's logprob row).
    logprob_rows: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_outputs: int = 0


@dataclass
class StepRecord:
    """What one model step saw and produced."""

    scheduled: dict[str, int]
    spec_tokens: dict[str, list[int]]
    # req_id -> bitmask rows (np.int32 arrays) for that request, or None.
    bitmask_rows: dict[str, np.ndarray] | None
    num_acceptable_drafts: dict[str, int] | None
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # Engine-loop emulation (engine_setup/engine_step) only:
    # req_id -> the tokens the worker had for it when the step was launched
    # (its output so far as the model saw it: earlier steps' samples, applied
    # or not), for every request that samples in the step.
    ctx: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> the drafts the drafter proposed that this step verifies.
    raw_drafts: dict[str, list[int]] = field(default_factory=dict)


def fake_runner_output(so: Any, sampled: dict[str, list[int]],
                       logprobs: bool = False,
                       kv_connector_output: Any = None) -> Any:
    """The harness's one fake: the model runner's output for scheduler output
    `so`. `sampled[req_id]` are the tokens the sampler returned for a request
    (accepted drafts + bonus; none for an unlisted request, e.g. a prefill
    chunk); with `logprobs`, one logprob row per token."""
    from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput

    req_ids = list(so.num_scheduled_tokens)
    lists = [list(sampled.get(r, [])) for r in req_ids]
    lp = None
    if logprobs:
        cu = [0]
        for tokens in lists:
            cu.append(cu[-1] + len(tokens))
        n = cu[-1]
        ids = np.array([[t] for tokens in lists for t in tokens],
                       dtype=np.int64).reshape(n, 1)
        lp = LogprobsLists(ids, np.full((n, 1), -0.5, dtype=np.float32),
                           np.zeros(n, dtype=np.int64), cu[:-1])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=lists,
        logprobs=lp,
        kv_connector_output=kv_connector_output,
    )

def bare_eagle_proposer(vllm_config: Any, model: Any, k: int) -> Any:
    """vLLM's own EagleProposer without its __init__ (which loads a model and
    allocates device buffers): the attributes `_sample_draft_tokens` and
    grammar-aware drafting read, on the CPU, drafting `k` tokens with
    `model.compute_logits`. For the fuzzer's and the cost benchmark's
    drafters."""
    import torch
    from vllm.v1.spec_decode.eagle import EagleProposer

    d = EagleProposer.__new__(EagleProposer)
    d.vllm_config = vllm_config
    d.model = model
    d._enable_probabilistic_draft_probs = False
    d.use_local_argmax_reduction = False
    d.use_heterogeneous_vocab = False
    d.parallel_drafting = False
    d.num_speculative_tokens = k
    d.device = torch.device("cpu")
    return d


class Harness:
    """A real scheduler driven by hand. See the module docstring."""

    def __init__(
        self,
        backend: str = "xgrammar",
        *,
        async_scheduling: bool = False,
        num_spec_tokens: int = 0,
        block_size: int = 4,
        num_blocks: int = 64,
        reasoning_parser: str | None = None,
        max_model_len: int = 512,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        kv_transfer_config: Any = None,
        disable_any_whitespace: bool = False,
        max_logprobs: int = 5,
    ) -> None:
        from vllm.config import (
            CacheConfig,
            ModelConfig,
            SchedulerConfig,
            SpeculativeConfig,
            StructuredOutputsConfig,
            VllmConfig,
        )
        from vllm.v1.core.kv_cache_utils import (
            get_request_block_hasher,
            init_none_hash,
        )
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        path = str(tiny_model.build_target())
        self.model_path = path
        self.num_spec_tokens = num_spec_tokens
        self.async_scheduling = async_scheduling
        self.block_size = block_size

        model_config = ModelConfig(
            model=path, tokenizer=path, dtype="float32", seed=0,
            max_model_len=max_model_len, max_logprobs=max_logprobs,
        )
        cache_config = CacheConfig(
            block_size=block_size, enable_prefix_caching=enable_prefix_caching,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ) if _accepts(SchedulerConfig, "is_encoder_decoder") else SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
        )
        speculative_config = None
        if num_spec_tokens:
            # The scheduler's update path has no method-specific code; ngram
            # needs no draft model weights.
            speculative_config = SpeculativeConfig(
                method="ngram", num_speculative_tokens=num_spec_tokens,
                prompt_lookup_max=2, prompt_lookup_min=1,
            )
        so_kw: dict[str, Any] = dict(backend=backend,
                                     reasoning_parser=reasoning_parser or "")
        if disable_any_whitespace:
            so_kw["disable_any_whitespace"] = True
        so_config = StructuredOutputsConfig(**so_kw)
        # kv_transfer_config (a vllm.config.KVTransferConfig): the scheduler
        # builds the connector's scheduler side from it, as in a P/D
        # instance; the worker side is simulated (`KVWorkerSim`).
        self.vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            speculative_config=speculative_config,
            structured_outputs_config=so_config,
            kv_transfer_config=kv_transfer_config,
        )
        # VllmConfig validation turns async off for some combinations (CPU,
        # ngram); set it afterwards, as the audit did.
        self.vllm_config.scheduler_config.async_scheduling = async_scheduling
        cache_config.num_gpu_blocks = num_blocks

        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer"],
                    FullAttentionSpec(block_size=block_size, num_kv_heads=1,
                                      head_size=32, dtype=torch.float32),
                )
            ],
        )
        self.structured_output_manager = StructuredOutputManager(self.vllm_config)
        if async_scheduling:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler as cls
        else:
            from vllm.v1.core.sched.scheduler import Scheduler as cls
        kwargs: dict[str, Any] = dict(
            vllm_config=self.vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=self.structured_output_manager,
            log_stats=True,
            block_size=block_size,
        )
        if _accepts(cls, "hash_block_size"):
            kwargs["hash_block_size"] = block_size
        self.scheduler = cls(**kwargs)

        from vllm.utils.hashing import get_hash_fn_by_name  # type: ignore

        hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(block_size, hash_fn)

        self.tokenizer = self.structured_output_manager.tokenizer
        self.generation_config = model_config.try_get_generation_config()
        self._held: dict[str, Any] = {}
        self.kv_worker: KVWorkerSim | None = None

        self._ids = itertools.count()
        self.emitted_by_req: dict[str, Emitted] = {}
        self.requests: dict[str, Any] = {}
        self.steps: list[StepRecord] = []
        self.spec_stats: list[Any] = []
        # Async engine loop: scheduler outputs launched but not yet applied.
        self.in_flight: deque[Any] = deque()

    # ------------------------------------------------------------------ tokens
    def tok(self, text: str) -> int:
        """The single token id of `text` (fails if it is not one token)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) == 1, (text, ids)
        return ids[0]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ---------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: list[int] | None = None,
        *,
        regex: str | None = None,
        grammar: str | None = None,
        json: Any = None,
        choice: list[str] | None = None,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        stop_token_ids: list[int] | None = None,
        min_tokens: int = 0,
        max_tokens: int = 64,
        request_id: str | None = None,
        wait: bool = True,
        kv_transfer_params: dict[str, Any] | None = None,
        hold_grammar: bool = False,
    ) -> str:
        """Add a request the way EngineCore does (params verified, generation
        config applied, grammar compiling). Returns the request id.
        `kv_transfer_params`: the request's P/D params (needs a
        kv_transfer_config). `hold_grammar`: the grammar looks still
        compiling until `release_grammar(rid)` (deterministic order of
        "grammar ready" vs other events)."""
        from vllm.sampling_params import SamplingParams, StructuredOutputsParams
        from vllm.v1.request import Request

        so = None
        if any(x is not None for x in (regex, grammar, json, choice)):
            so = StructuredOutputsParams(regex=regex, grammar=grammar, json=json,
                                         choice=choice)
        sp = SamplingParams(
            max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
            logprobs=logprobs, stop_token_ids=stop_token_ids,
            structured_outputs=so, temperature=0.0,
        )
        mc = self.vllm_config.model_config
        sp.verify(mc, self.vllm_config.speculative_config,
                  self.vllm_config.structured_outputs_config, self.tokenizer)
        sp.update_from_generation_config(self.generation_config,
                                         self.tokenizer.eos_token_id)
        sp.update_from_tokenizer(self.tokenizer)
        rid = request_id or f"r{next(self._ids)}"
        req = Request(
            request_id=rid,
            prompt_token_ids=list(prompt or [self.tok("x"), self.tok("y")]),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=self._block_hasher,
        )
        if kv_transfer_params is not None:
            req.kv_transfer_params = dict(kv_transfer_params)
        if req.use_structured_output:
            self.structured_output_manager.grammar_init(req)
            if hold_grammar:
                from concurrent.futures import Future

                so_req = req.structured_output_request
                held: Future = Future()
                self._held[rid] = (held, so_req._grammar)  # noqa: SLF001
                so_req.grammar = held
                wait = False
        self.scheduler.add_request(req)
        self.requests[rid] = req
        self.emitted_by_req[rid] = Emitted()
        if wait and req.use_structured_output:
            self.wait_for_grammar(rid)
        return rid

    def release_grammar(self, rid: str, error: bool = False) -> None:
        """Finish the held grammar compile of `rid` (with `error`: as a
        failed compile)."""
        held, real = self._held.pop(rid)
        if error:
            held.set_exception(ValueError("grammar failed to compile (test)"))
            return
        held.set_result(real.result() if hasattr(real, "result") else real)

    def wait_for_grammar(self, rid: str, timeout: float = 60.0) -> None:
        so_req = self.requests[rid].structured_output_request
        deadline = time.monotonic() + timeout
        while not so_req._check_grammar_completion():  # noqa: SLF001
            if time.monotonic() > deadline:
                raise TimeoutError(f"grammar for {rid} did not compile")
            time.sleep(0.005)

    def request(self, rid: str) -> Any:
        return self.requests[rid]

    def grammar(self, rid: str) -> Any:
        return self.requests[rid].structured_output_request.grammar

    # ------------------------------------------------------------------- steps
    def schedule(self) -> Any:
        """schedule() plus the grammar bitmask, recorded as a StepRecord."""
        so = self.scheduler.schedule()
        self.steps.append(StepRecord(
            scheduled=dict(so.num_scheduled_tokens),
            spec_tokens={k: list(v) for k, v in
                         so.scheduled_spec_decode_tokens.items()},
            bitmask_rows=None, num_acceptable_drafts=None,
        ))
        so._vllm_patch_record = self.steps[-1]  # type: ignore[attr-defined]
        return so

    def grammar_bitmask(self, so: Any) -> None:
        """Build the grammar bitmask of step `so` (the scheduler's
        `get_grammar_bitmask`, as EngineCore does before sampling) and record
        each request's rows and `num_acceptable_drafts` on its StepRecord."""
        record: StepRecord = so._vllm_patch_record
        out = self.scheduler.get_grammar_bitmask(so)
        if out is None:
            return
        rows: dict[str, np.ndarray] = {}
        bm = out.grammar_bitmask
        k1 = self.num_spec_tokens + 1
        # 0.33: fixed stride of k+1 rows per request; 0.32: cumulative. Both
        # order rows like structured_output_request_ids.
        offset = 0
        for i, rid in enumerate(out.structured_output_request_ids):
            n = 1 + len([t for t in so.scheduled_spec_decode_tokens.get(rid, ())])
            if bm.shape[0] == len(out.structured_output_request_ids) * k1:
                start = i * k1
            else:
                start = offset
            rows[rid] = np.array(bm[start:start + n])
            offset += n
        record.bitmask_rows = rows
        if out.num_acceptable_drafts is not None:
            record.num_acceptable_drafts = dict(zip(
                out.structured_output_request_ids, out.num_acceptable_drafts))

    def allowed(self, row: np.ndarray) -> list[int]:
        """Token ids a bitmask row allows (within the tokenizer vocab)."""
        vocab = len(self.tokenizer)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")
        return [i for i in range(min(vocab, bits.size)) if bits[i]]

    def run_model(
        self,
        so: Any,
        sampled: dict[str, list[int]],
        logprobs: bool = True,
    ) -> dict[str, Any]:
        """Apply a fake ModelRunnerOutput for `so`; collect what was emitted.
        `sampled` gives, per request, the tokens the sampler returned (accepted
        drafts + bonus); unlisted scheduled requests return nothing (prefill
        chunk)."""
        record: StepRecord = so._vllm_patch_record
        record.sampled = {k: list(v) for k, v in sampled.items()}
        out = fake_runner_output(so, sampled, logprobs=logprobs)
        engine_outputs = self.scheduler.update_from_output(so, out)
        self._collect(engine_outputs)
        return engine_outputs

    def _collect(self, engine_outputs: dict[int, Any]) -> None:
        for eco in engine_outputs.values():
            if eco.scheduler_stats is not None and \
                    eco.scheduler_stats.spec_decoding_stats is not None:
                self.spec_stats.append(eco.scheduler_stats.spec_decoding_stats)
            for o in eco.outputs:
                em = self.emitted_by_req.setdefault(o.request_id, Emitted())
                em.num_outputs += 1
                em.token_ids.extend(o.new_token_ids)
                if o.new_logprobs is not None:
                    em.logprob_rows += len(o.new_logprobs.logprobs)
                if o.finish_reason is not None:
                    em.finish_reason = str(o.finish_reason)
                    em.stop_reason = o.stop_reason

    def step(
        self,
        sampled: dict[str, list[int]],
        drafts: dict[str, list[int]] | None = None,
        logprobs: bool = True,
        clip: bool = False,
    ) -> StepRecord:
        """Sync engine step: schedule, bitmask, apply `sampled`, then set the
        next drafts the way EngineCore.post_step does. `clip` cuts each
        request's sampled list to what a runner can return (1 + the drafts
        actually scheduled after validation); without it a longer list is an
        error, except that a deliberately over-long list is allowed for
        synthetic inputs when `clip` is None."""
        so = self.schedule()
        self.grammar_bitmask(so)
        spec = so.scheduled_spec_decode_tokens
        for rid in list(sampled):
            room = 1 + len(spec.get(rid, ()))
            if rid not in so.num_scheduled_tokens:
                sampled.pop(rid)
            elif len(sampled[rid]) > room:
                if clip:
                    sampled[rid] = sampled[rid][:room]
                elif clip is not None:
                    raise ValueError(
                        f"{rid}: runner cannot return {len(sampled[rid])} "
                        f"tokens for {room - 1} scheduled drafts")
        self.run_model(so, sampled, logprobs)
        if self.num_spec_tokens:
            self.set_drafts(drafts or {})
        return so._vllm_patch_record

    def set_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Sync: update_draft_token_ids after update_from_output (post_step).
        Running requests not in `drafts` get no drafts."""
        from vllm.v1.outputs import DraftTokenIds

        ids = [r.request_id for r in self.scheduler.running]
        self.scheduler.update_draft_token_ids(DraftTokenIds(
            ids, [list(drafts.get(r, [])) for r in ids]))

    # ------------------------------------------------------------ async loop
    def launch(self, drafts: dict[str, list[int]] | None = None) -> Any:
        """Async engine: schedule a step and launch it (it stays in flight).
        `drafts` are the worker's drafts for the requests scheduled with
        placeholder drafts in this step (update_draft_token_ids_in_output);
        the bitmask is computed only once every earlier step is applied
        (EngineCore defers sampling for pending structured output)."""
        so = self.schedule()
        so._vllm_patch_drafts = drafts  # type: ignore[attr-defined]
        self.in_flight.append(so)
        return so

    def finish_oldest(self, sampled: dict[str, list[int]],
                      logprobs: bool = True) -> StepRecord:
        """Apply the oldest in-flight step's output. Before its sampling, the
        real drafts of this step replace the placeholders and the bitmask is
        built (as step_with_batch_queue does after the previous update)."""
        from vllm.v1.outputs import DraftTokenIds

        so = self.in_flight.popleft()
        drafts = getattr(so, "_vllm_patch_drafts", None)
        if drafts:
            ids = list(drafts)
            self.scheduler.update_draft_token_ids_in_output(
                DraftTokenIds(ids, [list(drafts[r]) for r in ids]), so)
            so._vllm_patch_record.spec_tokens = {
                k: list(v) for k, v in so.scheduled_spec_decode_tokens.items()}
        self.grammar_bitmask(so)
        self.run_model(so, sampled, logprobs)
        return so._vllm_patch_record

    # ------------------------------------------------- engine loop emulation
    def engine_setup(self, depth: int = 1, sampler: Any = None,
                     drafter: Any = None) -> None:
        """Emulate EngineCore's loop: depth 1 = `EngineCore.step` (+
        `post_step`), depth > 1 = `step_with_batch_queue` with a batch queue
        of that size (sync or async scheduler, as built). The fake worker
        samples when EngineCore calls `sample_tokens` (immediately, or
        deferred for pending structured output), from the bitmask rows it
        was given:

        - `sampler(h, req_id, ctx, rows, spec_tokens) -> list[int]`: tokens
          returned (accepted drafts + bonus); `ctx` is what the worker has
          for the request (all earlier launched steps' samples), `rows` the
          request's bitmask rows or None.
        - `drafter(h, req_id, ctx) -> list[int]`: drafts proposed after the
          request's newest sampled step (taken as EngineCore does: async in
          the deferred branch, sync in post_step); a drafter with a
          `batch(h, req_ids, ctxs) -> {req_id: drafts}` method proposes
          for the step's rows at once.
        """
        self.engine_depth = depth
        self.batch_queue: deque[Any] = deque()
        self.sampler = sampler
        self.drafter = drafter
        self.worker_ctx: dict[str, list[int]] = {}
        self._ctx_mark: dict[str, Any] = {}
        self._ctx_resets: dict[str, int] = {}
        self._raw_drafts: dict[str, list[int]] = {}
        self._last_sampled: Any = None
        self.sampling: Any = None
        # id(scheduler output) -> block ids reported as failed KV loads
        self._kv_fail: dict[int, set[int]] = {}

    def fail_kv_load(self, so: Any, block_ids: Any,
                     recompute: Any = ()) -> None:
        """Report `block_ids` as failed KV loads in `so`'s runner output;
        the worker rebuilds the `recompute` requests from the scheduler's
        tokens for the steps launched after that output is processed."""
        self._kv_fail[id(so)] = (set(block_ids), list(recompute))

    def reset_worker_ctx(self, rid: str) -> None:
        """The worker rebuilds `rid` from the scheduler's tokens for steps
        launched from now on (recompute after a KV-load failure)."""
        self._ctx_resets[rid] = self._ctx_resets.get(rid, 0) + 1

    def _engine_launch(self, so: Any) -> None:
        rec: StepRecord = so._vllm_patch_record
        if self.kv_worker is not None:
            self.kv_worker.launch(so)
        samples = []
        for rid in so.num_scheduled_tokens:
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue
            mark = (req.num_preemptions, self._ctx_resets.get(rid, 0))
            if self._ctx_mark.get(rid) != mark or rid not in self.worker_ctx:
                self.worker_ctx[rid] = list(req.output_token_ids)
                self._ctx_mark[rid] = mark
            if not req.is_prefill_chunk:
                samples.append(rid)
                rec.ctx[rid] = list(self.worker_ctx[rid])
                spec = so.scheduled_spec_decode_tokens.get(rid)
                if spec and rid in self._raw_drafts and \
                        not self.async_scheduling:
                    rec.raw_drafts[rid] = self._raw_drafts.pop(rid)
        so._vllm_patch_samples = samples  # type: ignore[attr-defined]

    def _engine_sample(self, so: Any) -> None:
        self.grammar_bitmask(so)
        rec: StepRecord = so._vllm_patch_record
        out: dict[str, list[int]] = {}
        # The step being sampled (a drafter proposing for the rows
        # scheduled with placeholders reads their batch from it).
        self.sampling = so
        try:
            for rid in so._vllm_patch_samples:
                rows = rec.bitmask_rows.get(rid) if rec.bitmask_rows else None
                spec = list(so.scheduled_spec_decode_tokens.get(rid, ()))
                toks = list(self.sampler(self, rid, rec.ctx[rid], rows, spec))
                out[rid] = toks
                self.worker_ctx.setdefault(rid, []).extend(toks)
        finally:
            self.sampling = None
        rec.sampled = out
        self._last_sampled = so

    # Whether the engine-loop emulation sends one logprob row per token.
    engine_logprobs = False

    def _engine_apply(self, so: Any) -> None:
        from vllm.v1.outputs import KVConnectorOutput

        kv = None
        failed, recompute = self._kv_fail.pop(id(so), (None, ()))
        kw: dict[str, Any] = {}
        if self.kv_worker is not None:
            kw = self.kv_worker.output(so)
        if failed:
            kw["invalid_block_ids"] = set(kw.get("invalid_block_ids", ())) | failed
        if kw:
            kv = KVConnectorOutput(**kw)
        out = fake_runner_output(so, so._vllm_patch_record.sampled,
                                 logprobs=self.engine_logprobs,
                                 kv_connector_output=kv)
        self._collect(self.scheduler.update_from_output(so, out))
        for rid in recompute:
            self.reset_worker_ctx(rid)

    def _engine_drafts(self) -> Any:
        from vllm.v1.outputs import DraftTokenIds

        last = self._last_sampled
        if self.drafter is None or last is None:
            return None
        ids = [r for r in last._vllm_patch_samples
               if r in self.scheduler.requests]
        ctxs = {r: list(self.worker_ctx.get(r, [])) for r in ids}
        batch = getattr(self.drafter, "batch", None)
        if batch is not None:  # one propose over the batch
            raw = {r: list(x) for r, x in batch(self, ids, ctxs).items()}
        else:
            raw = {r: list(self.drafter(self, r, ctxs[r])) for r in ids}
        return DraftTokenIds(ids, [raw[r] for r in ids]), raw

    def engine_step(self) -> bool:
        """One EngineCore step (+ post_step). Returns model_executed."""
        sched = self.scheduler
        executed = False
        if self.engine_depth <= 1:
            if not sched.has_requests():
                return False
            so = self.schedule()
            self._engine_launch(so)
            self._engine_sample(so)
            self._engine_apply(so)
            executed = so.total_num_scheduled_tokens > 0
        else:
            executed = self._engine_step_queue()
        if not self.async_scheduling and executed and self.num_spec_tokens:
            got = self._engine_drafts()  # post_step
            if got is not None:
                dt, raw = got
                self._raw_drafts.update({r: d for r, d in raw.items() if d})
                sched.update_draft_token_ids(dt)
        return executed

    def _engine_step_queue(self) -> bool:
        sched = self.scheduler
        q = self.batch_queue
        deferred = None
        executed = False
        if sched.has_requests():
            so = self.schedule()
            self._engine_launch(so)
            executed = so.total_num_scheduled_tokens > 0
            if executed:
                if not so.pending_structured_output_tokens:
                    self._engine_sample(so)
                else:
                    deferred = so
            else:
                so._vllm_patch_record.sampled = {}
            if deferred is None:
                q.appendleft(so)
                if len(q) < self.engine_depth and (executed or sched.has_requests()):
                    return executed
        elif not q:
            return False
        self._engine_apply(q.pop())
        if deferred is not None:
            if self.num_spec_tokens:
                got = self._engine_drafts()
                if got is not None:
                    dt, raw = got
                    sched.update_draft_token_ids_in_output(dt, deferred)
                    rec = deferred._vllm_patch_record
                    rec.spec_tokens = {k: list(v) for k, v in
                                       deferred.scheduled_spec_decode_tokens.items()}
                    for r in rec.spec_tokens:
                        if r in raw:
                            rec.raw_drafts[r] = raw[r]
            self._engine_sample(deferred)
            q.appendleft(deferred)
        return executed

    def engine_drain(self, max_steps: int = 200) -> None:
        """Run engine steps until nothing is in flight or scheduled."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not self.batch_queue:
                return
            self.engine_step()

    # ---------------------------------------------------------------- reading
    def emitted(self, rid: str) -> Emitted:
        return self.emitted_by_req[rid]

    def spec_totals(self) -> tuple[int, int, list[int]]:
        """(drafts, accepted, accepted per position) summed over all steps."""
        d = a = 0
        per_pos: list[int] = []
        for s in self.spec_stats:
            d += s.num_draft_tokens
            a += s.num_accepted_tokens
            for i, n in enumerate(s.num_accepted_tokens_per_pos):
                if i >= len(per_pos):
                    per_pos.append(0)
                per_pos[i] += n
        return d, a, per_pos

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def total_blocks(self) -> int:
        # One block (the null block) is never handed out.
        return self.scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1

    def held_blocks(self) -> int:
        return self.total_blocks() - self.free_blocks()

    def prefix_hit(self, prompt: list[int]) -> int:
        """Tokens of `prompt` the prefix cache would serve (read-only probe)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        probe = Request(request_id=f"probe{next(self._ids)}",
                        prompt_token_ids=list(prompt),
                        sampling_params=SamplingParams(max_tokens=1),
                        pooling_params=None, block_hasher=self._block_hasher)
        # (blocks, num_computed_tokens, boundary) on 0.32 and 0.33.
        return self.scheduler.kv_cache_manager.get_computed_blocks(probe)[1]

    def drain(self) -> None:
        """Idle the engine: apply in-flight steps with no output, abort the
        rest so the block pool can be checked."""
        from vllm.v1.request import RequestStatus

        while self.in_flight:
            self.finish_oldest({})
        live = [r for r, q in self.requests.items() if not q.is_finished()]
        if live:
            self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)


class KVWorkerSim:
    """The worker side of a KV connector, simulated from the connector
    metadata the real scheduler side (e.g. NixlConnector's) puts in each
    scheduler output, as the engine-loop emulation's model runner output:

    - a load listed in `reqs_to_recv` (its local blocks; only when it
      awaits KV, as NixlConnector's worker decides) is reported in
      `finished_recving` in the output of the step launched `delay` steps
      after the one that carried it (0: the same step), failed or not;
    - a send listed in `reqs_to_send` (blocks pinned after a prefill
      instance's request finished) is reported in `finished_sending`
      likewise;
    - `plan(req_id, kind) -> (delay, failure)` decides, once per transfer;
      failure (loads only): None, "blocks" (some block ids in
      `invalid_block_ids`, from `fail_block`), "request" (`failed_recving`
      only) or "nixl" (NixlConnector's worker: `failed_recving` and every
      local block in `invalid_block_ids`).

    A transfer is never reported in the output of a step launched before
    the step that carried it (the worker runs steps in order)."""

    def __init__(self, plan: Any, fail_block: Any = None) -> None:
        self.plan = plan
        self.fail_block = fail_block or (lambda rid, n: 0)
        self.seq = 0
        self.seq_of: dict[int, int] = {}
        # (due seq, kind, req_id, block ids, failure)
        self.pending: list[tuple[int, str, str, list[int], str | None]] = []
        self.started: set[tuple[str, str]] = set()
        self.reported: list[tuple[str, str, str | None]] = []
        self.has_failed_recving = "failed_recving" in _fields("KVConnectorOutput")

    def launch(self, so: Any) -> None:
        self.seq += 1
        self.seq_of[id(so)] = self.seq
        meta = getattr(so, "kv_connector_metadata", None)
        if meta is None:
            return
        for rid, m in (getattr(meta, "reqs_to_recv", None) or {}).items():
            # NixlConnector's worker awaits (and reports) a receive only
            # when there is something to load; notify-only entries (full
            # local hit, cleanup of an aborted request) are never reported.
            if not (getattr(m, "awaiting_kvs", False)
                    or any(m.local_block_ids or ())):
                continue
            if ("recv", rid) in self.started:
                continue
            self.started.add(("recv", rid))
            blocks = [b for g in (m.local_block_ids or ()) for b in g]
            delay, failure = self.plan(rid, "recv")
            self.pending.append((self.seq + delay, "recv", rid, blocks, failure))
        for rid in (getattr(meta, "reqs_to_send", None) or {}):
            if ("send", rid) in self.started:
                continue
            self.started.add(("send", rid))
            delay, _ = self.plan(rid, "send")
            self.pending.append((self.seq + delay, "send", rid, [], None))

    def output(self, so: Any) -> dict[str, Any]:
        seq = self.seq_of.pop(id(so), self.seq)
        kw: dict[str, Any] = {}
        keep = []
        for item in self.pending:
            due, kind, rid, blocks, failure = item
            if due > seq:
                keep.append(item)
                continue
            self.reported.append((kind, rid, failure))
            if kind == "send":
                kw.setdefault("finished_sending", set()).add(rid)
                continue
            kw.setdefault("finished_recving", set()).add(rid)
            if failure in ("request", "nixl") and not self.has_failed_recving:
                failure = "blocks" if failure == "request" else "all"
            if failure in ("request", "nixl"):
                kw.setdefault("failed_recving", set()).add(rid)
            if failure in ("nixl", "all") and blocks:
                kw.setdefault("invalid_block_ids", set()).update(blocks)
            elif failure == "blocks" and blocks:
                i = self.fail_block(rid, len(blocks)) % len(blocks)
                kw.setdefault("invalid_block_ids", set()).add(blocks[i])
        self.pending = keep
        return kw

    def busy(self) -> bool:
        return bool(self.pending)


def _fields(name: str) -> set[str]:
    import dataclasses

    from vllm.v1 import outputs

    cls = getattr(outputs, name, None)
    try:
        return {f.name for f in dataclasses.fields(cls)}
    except TypeError:
        return set()


def _accepts(cls: Any, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
