"""Scheduler-tier P/D decode harness (tests/v1/kv_connector, conformance g4,
benchmarks/bench_pd_ttft.py): the real vLLM Scheduler / AsyncScheduler
with the real NixlConnector (scheduler role only: no nixl, no transfer), the
real StructuredOutputManager (xgrammar) and KV cache manager, the tiny local
model; model runner outputs are made by hand (after vLLM's
tests/v1/kv_connector/unit/utils.py). Works on vLLM 0.32 and 0.33.

The scheduler is built by the scheduler harness
(`vllm_patch.testing.harness.Harness` with a `kv_transfer_config`), the one
construction path of the tests, the conformance scenarios and the fuzzer.
The grammar future of a request can be held back (`hold_grammar`) and
released (`release_grammar`) to control the order "grammar ready" vs
"KV arrived"; every block free is recorded to check "freed exactly once".
"""

from __future__ import annotations

import collections
import inspect
import itertools
from concurrent.futures import Future
from typing import Any

from vllm_patch.testing import tiny_model

EOS, IM_END = tiny_model.EOS, tiny_model.IM_END
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                 "maximum": 9}},
          "required": ["a"], "additionalProperties": False}


class PDDecodeSched:
    def __init__(self, *, async_scheduling: bool = False, num_spec_tokens: int = 0,
                 kv_load_failure_policy: str = "fail", block_size: int = 16,
                 num_blocks: int = 128) -> None:
        from vllm.config import KVTransferConfig

        from vllm_patch.testing.harness import Harness

        self.block_size = block_size
        self.num_spec_tokens = num_spec_tokens
        # One construction path for the scheduler (config, kwargs probed per
        # vLLM version, block hasher): the scheduler harness, with the
        # connector's scheduler side built by vLLM from kv_transfer_config.
        kv = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_consumer",
                              kv_load_failure_policy=kv_load_failure_policy)
        self.harness = Harness(
            "xgrammar", async_scheduling=async_scheduling,
            num_spec_tokens=num_spec_tokens, block_size=block_size,
            num_blocks=num_blocks, max_num_seqs=16, max_num_batched_tokens=1024,
            kv_transfer_config=kv, disable_any_whitespace=True)
        self.vllm_config = self.harness.vllm_config
        self.som = self.harness.structured_output_manager
        self.sched = self.harness.scheduler
        self._hasher = self.harness._block_hasher  # noqa: SLF001
        self.tokenizer = self.som.tokenizer
        self._ids = itertools.count()
        self.requests: dict[str, Any] = {}
        self.outputs: dict[str, list[Any]] = collections.defaultdict(list)
        self._held: dict[str, Any] = {}
        self.in_flight: collections.deque = collections.deque()
        # free accounting: block id -> number of frees while allocated
        self.free_events: collections.Counter = collections.Counter()
        pool = self.sched.kv_cache_manager.block_pool
        orig_free = pool.free_blocks

        def free_blocks(blocks, *a, **k):
            blocks = list(blocks)
            for b in blocks:
                if b.ref_cnt == 1 and not b.is_null:
                    self.free_events[b.block_id] += 1
                assert b.ref_cnt >= 1, f"block {b.block_id} freed with ref_cnt {b.ref_cnt}"
            return orig_free(blocks, *a, **k)

        pool.free_blocks = free_blocks
        self.allocations: collections.Counter = collections.Counter()
        orig_get = pool.get_new_blocks

        def get_new_blocks(n, *a, **k):
            out = orig_get(n, *a, **k)
            for b in out:
                self.allocations[b.block_id] += 1
            return out

        pool.get_new_blocks = get_new_blocks

    # ---------------------------------------------------------------- requests
    def add_remote_request(self, *, prompt_len: int = 40, json: Any = SCHEMA,
                           regex: str | None = None, max_tokens: int = 48,
                           hold_grammar: bool = True, grammar_error: bool = False,
                           remote: bool = True, prompt_logprobs: int | None = None
                           ) -> str:
        from vllm.sampling_params import SamplingParams, StructuredOutputsParams
        from vllm.v1.request import Request

        so = StructuredOutputsParams(json=json) if regex is None else \
            StructuredOutputsParams(regex=regex)
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=so,
                            prompt_logprobs=prompt_logprobs)
        sp.verify(self.vllm_config.model_config, self.vllm_config.speculative_config,
                  self.vllm_config.structured_outputs_config, self.tokenizer)
        sp.update_from_generation_config({}, self.tokenizer.eos_token_id)
        sp.update_from_tokenizer(self.tokenizer)
        n = next(self._ids)
        rid = f"d{n}"
        prompt = [(7 + n * 13 + i) % 300 + 10 for i in range(prompt_len)]
        req = Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                      pooling_params=None, block_hasher=self._hasher)
        if remote:
            req.kv_transfer_params = dict(
                do_remote_prefill=True, do_remote_decode=False,
                remote_engine_id="prefill-engine", remote_request_id=f"p-{rid}",
                remote_block_ids=list(range((prompt_len + self.block_size - 1)
                                            // self.block_size)),
                remote_host="127.0.0.1", remote_port=1234, tp_size=1)
        self.som.grammar_init(req)
        so_req = req.structured_output_request
        real = so_req._grammar  # a Future from the compile pool
        if hold_grammar or grammar_error:
            fut: Future = Future()
            so_req.grammar = fut
            self._held[rid] = (fut, real, grammar_error)
        self.sched.add_request(req)
        self.requests[rid] = req
        return rid

    def wait_grammar(self, rid: str, timeout: float = 60.0) -> None:
        """Block until the (not held) grammar future of `rid` is done."""
        fut = self.requests[rid].structured_output_request._grammar
        if hasattr(fut, "result"):
            try:
                fut.result(timeout)
            except Exception:  # noqa: BLE001 - a failed compile is a result too
                pass

    def release_grammar(self, rid: str) -> None:
        fut, real, err = self._held.pop(rid)
        if err:
            fut.set_exception(ValueError("grammar failed to compile (test)"))
        else:
            fut.set_result(real.result() if hasattr(real, "result") else real)

    # ------------------------------------------------------------------- steps
    def schedule(self) -> Any:
        return self.sched.schedule()

    def model_output(self, so: Any, *, finished_recving: set[str] | None = None,
                     invalid_block_ids: set[int] | None = None,
                     token: int | None = None) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for r in req_ids:
            req = self.sched.requests.get(r)
            if token is not None:
                sampled.append([token])
            else:  # a token the grammar accepts: first allowed by a fresh matcher
                sampled.append([self._allowed_token(req)])
        kvo = None
        if finished_recving is not None or invalid_block_ids is not None:
            kvo = KVConnectorOutput(finished_recving=finished_recving or set(),
                                    invalid_block_ids=invalid_block_ids or set())
        kw = dict(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                  sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                  pooler_output=[], kv_connector_output=kvo)
        params = inspect.signature(ModelRunnerOutput).parameters
        return ModelRunnerOutput(**{k: v for k, v in kw.items() if k in params})

    def _allowed_token(self, req: Any) -> int:
        import numpy as np

        if req is None or req.structured_output_request is None:
            return 10
        g = req.structured_output_request.grammar
        if g is None or isinstance(g, Exception):
            return 10
        if g.is_terminated():
            return EOS
        bm = self.som.backend.allocate_token_bitmask(1)
        g.fill_bitmask(bm, 0)
        row = bm[0].numpy().astype(np.uint32)
        for t in range(6, row.size * 32):  # 0-5 are special tokens
            if row[t // 32] >> (t % 32) & 1:
                return t
        return EOS

    def step(self, **kw: Any) -> tuple[Any, dict]:
        so = self.schedule()
        mro = self.model_output(so, **kw)
        self.sched.get_grammar_bitmask(so)
        outs = self.sched.update_from_output(so, mro)
        for eco in outs.values():
            for o in eco.outputs:
                self.outputs[o.request_id].append(o)
        return so, outs

    def kv_arrived(self, rid: str, *, invalid: set[int] | None = None) -> Any:
        """A step whose connector output reports the load of `rid` done."""
        so = self.schedule()
        mro = self.model_output(so, finished_recving={rid}, invalid_block_ids=invalid)
        self.sched.get_grammar_bitmask(so)
        outs = self.sched.update_from_output(so, mro)
        for eco in outs.values():
            for o in eco.outputs:
                self.outputs[o.request_id].append(o)
        return so

    def run_to_idle(self, max_steps: int = 100) -> None:
        for _ in range(max_steps):
            if not self.sched.requests:
                return
            self.step()
        raise AssertionError(f"not idle: {list(self.sched.requests)}")

    # ------------------------------------------------------------------ checks
    def held_blocks(self) -> int:
        pool = self.sched.kv_cache_manager.block_pool
        return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()

    def req_blocks(self, rid: str) -> list[int]:
        mgr = self.sched.kv_cache_manager
        try:
            blocks = mgr.get_block_ids(rid)
        except (KeyError, AssertionError):
            return []
        return [b for g in blocks for b in g]

    def finish_reason(self, rid: str) -> str | None:
        for o in self.outputs.get(rid, []):
            if o.finish_reason is not None:
                return str(o.finish_reason)  # FinishReason.__str__: "stop", ...
        return None

    def assert_idle_no_leak(self) -> None:
        s = self.sched
        pool = s.kv_cache_manager.block_pool
        assert not s.requests, list(s.requests)
        assert len(s.running) == 0
        assert not s.finished_recving_kv_req_ids
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks if not b.is_null)
        # every allocation freed exactly once
        for bid, n in self.allocations.items():
            assert self.free_events[bid] == n, (bid, n, self.free_events[bid])
