"""G3 for vllm.v1.worker.gpu_model_runner (the V1 model runner): the V1 runner honours
`num_acceptable_drafts`.

`GrammarOutput.num_acceptable_drafts[i]` is the scheduler's contract that
drafts from that index on must not be accepted (`v1/core/sched/output.py`):
they come after the grammar's end or after a grammar-invalid draft. Model
Runner V2 enforces it (`grammar_invalid_drafts`); the V1 runner (the one the
CPU build always uses and the CUDA build's fallback) never reads it. Under
async scheduling the V1 runner verifies its OWN drafts (scattered into
`input_ids` from the previous step's GPU drafts), not the scheduler's
-1-padded copy, so post-terminal drafts can be accepted (audit P3).

Patch: wrap `GPUModelRunner.sample_tokens`. Before the stock method runs the
rejection sampler, every draft of a structured request at a position
>= num_acceptable_drafts is set to -1 in `spec_decode_metadata
.draft_token_ids` (a copy gathered from `input_ids`, used only by the
rejection sampler). The V1 rejection kernels reject -1 drafts (greedy:
-1 never equals the argmax; random: `draft_token_id < 0`; FLy and synthetic
mode: `>= 0` checks), so the token at the first unacceptable position is the
target's sample from that position's bitmask row, which
`vllm_patch.v1.structured_output` makes the valid-prefix or stop-only row.
Requests whose drafts are all acceptable cost nothing; one small index copy
to the device is made only when some draft must be rejected.

Also here: `g3-no-drafts-after-grammar-end` and
`g3-no-drafts-handed-over-after-grammar-end` (no draft proposals for
requests whose grammar ends; see the section below and
`vllm_patch.v1.spec_decode.grammar_end`).
"""

from __future__ import annotations

from typing import Any, Sequence

from vllm_patch.audited import pin
from vllm_patch.patching import Patch
from vllm_patch.v1.spec_decode import grammar_end
from vllm_patch.v1.spec_decode.grammar_end import draft_skip_stats, draft_stats

__all__ = ["draft_skip_stats"]


def unacceptable_draft_positions(
    batch_req_ids: Sequence[str],
    num_draft_tokens: Sequence[int],
    grammar_req_ids: Sequence[str],
    num_acceptable_drafts: Sequence[int],
) -> list[int]:
    """Flat indices (into the rejection sampler's draft_token_ids, batch
    order) of the drafts that must not be accepted."""
    acceptable = dict(zip(grammar_req_ids, num_acceptable_drafts))
    positions: list[int] = []
    start = 0
    for req_id, n in zip(batch_req_ids, num_draft_tokens):
        limit = acceptable.get(req_id)
        if limit is not None and limit < n:
            positions.extend(range(start + max(limit, 0), start + n))
        start += n
    return positions


def mask_unacceptable_drafts(
    draft_token_ids: Any,
    batch_req_ids: Sequence[str],
    num_draft_tokens: Sequence[int],
    grammar_req_ids: Sequence[str],
    num_acceptable_drafts: Sequence[int] | None,
) -> int:
    """Set unacceptable drafts to -1 in place; returns how many."""
    if num_acceptable_drafts is None:
        return 0
    positions = unacceptable_draft_positions(
        batch_req_ids, num_draft_tokens, grammar_req_ids, num_acceptable_drafts)
    if positions:
        import torch

        index = torch.tensor(positions, dtype=torch.long)
        if draft_token_ids.device.type != "cpu":
            index = index.pin_memory().to(draft_token_ids.device,
                                          non_blocking=True)
        draft_token_ids.index_fill_(0, index, -1)
    return len(positions)


def _make_sample_tokens(original: Any) -> Any:
    def sample_tokens(self: Any, grammar_output: Any) -> Any:
        state = getattr(self, "execute_model_state", None)
        if grammar_output is not None and state is not None:
            meta = getattr(state, "spec_decode_metadata", None)
            if meta is not None:
                mask_unacceptable_drafts(
                    meta.draft_token_ids,
                    self.input_batch.req_ids,
                    meta.num_draft_tokens,
                    grammar_output.structured_output_request_ids,
                    grammar_output.num_acceptable_drafts,
                )
        # Step context for g3-no-drafts-after-grammar-end: the proposer runs
        # inside the stock sample_tokens and never sees grammar_output.
        begin_step(self, grammar_output)
        try:
            return original(self, grammar_output)
        finally:
            self.__dict__[_GRAMMAR_ATTR] = None

    return sample_tokens


# --------------------------------------------------------------------------
# No drafts for requests whose grammar ends.
#
# Where: `GPUModelRunner.propose_draft_token_ids`, the one call through which
# the V1 runner runs every proposer (sample_tokens' nested helper calls it
# right after sampling, before bookkeeping for EAGLE / draft_model). It is
# the smallest place that both sees this step's sampled tokens and can avoid
# the drafter's forward passes; the proposers themselves (EagleProposer,
# DraftModelProposer) know nothing of grammars or of the batch's requests.
#
# When every request of the batch ends (it samples a grammar stop token now,
# or it ended in the previous step whose follow-up step was already in
# flight under async scheduling: the scheduler, having finished it, leaves
# it out of this step's grammar output), the drafter is not called: the runner
# takes stock's own "input does not fit in the drafter" path instead (zero
# drafts of shape [num_reqs, k]; under async scheduling the sampled tokens
# are still prepared for the next step's inputs by the drafter's
# prepare_next_token_ids_padded, exactly as in that stock path). Saved: the
# drafter's k forward passes. When only some requests end, the drafter runs
# for the whole batch as in stock (the padded batch cannot drop rows), and
# those requests hand the scheduler no drafts (`take_draft_token_ids`):
# nothing is saved there, it only guarantees no draft of an ended grammar
# is ever scheduled. Unstructured requests keep stock drafting: a batch with
# one that has not ended is never skipped, and the sampled tokens are then
# not even read. Cost: a Python pass over the batch in steps with structured
# requests, and one device-to-host copy of the sampled tokens only in steps
# where the bitmask rows say every request may end (on CUDA that copy waits
# for the sampler before the drafter is launched).
# --------------------------------------------------------------------------

_GRAMMAR_ATTR = "_vllm_patch_g3_grammar_output"
_DROP_ATTR = "_vllm_patch_g3_drop"        # req_ids: hand over no drafts


def begin_step(runner: Any, grammar_output: Any) -> None:
    """Called at each sample_tokens: the proposer inside it needs this step's
    grammar output and a step count (how old an ended request is)."""
    grammar_end.next_step(runner)
    runner.__dict__[_GRAMMAR_ATTR] = grammar_output
    runner.__dict__[_DROP_ATTR] = frozenset()


# Drafters whose stock "input does not fit in the drafter" path
# (GPUModelRunner.sample_tokens, pinned) `_skip_drafter` reproduces: the ones
# propose_draft_token_ids runs through its EAGLE / draft-model branch (stock
# asserts these classes there; subclasses such as Step3p5MTPProposer
# included). The skip is never taken for any other drafter, whose not-fits
# path was not mirrored: extract_hidden_states (its propose caches the
# target's hidden states in the KV cache for transfer, not only drafts),
# ngram on the GPU (stock keeps its token table in step with
# update_token_ids_ngram), and ngram / suffix / medusa (0.32) / custom
# proposers (no model forward to save).
COVERED_DRAFTERS = ("EagleProposer", "DFlashProposer", "DraftModelProposer",
                    "Gemma4Proposer")
_covered: list[tuple[type, ...]] = []


def _covered_classes() -> tuple[type, ...]:
    if not _covered:
        import vllm.v1.worker.gpu_model_runner as runner_module

        _covered.append(tuple(
            cls for name in COVERED_DRAFTERS
            if isinstance(cls := getattr(runner_module, name, None), type)))
    return _covered[0]


def _eligible(runner: Any) -> bool:
    """May the drafter of `runner` be skipped (see COVERED_DRAFTERS)?"""
    spec = getattr(runner, "speculative_config", None)
    if spec is None:
        return False
    use_dflash = getattr(spec, "use_dflash", None)
    if not (spec.use_eagle() or spec.uses_draft_model()
            or (use_dflash is not None and use_dflash())):
        return False  # not propose_draft_token_ids' EAGLE / draft-model branch
    if not isinstance(getattr(runner, "drafter", None), _covered_classes()):
        return False
    pc = getattr(runner, "parallel_config", None)
    # Pipeline parallel: only the last rank samples; keep stock there.
    return getattr(pc, "pipeline_parallel_size", 1) == 1



def _sampled_rows(sampled_token_ids: Any) -> list[list[int]]:
    if isinstance(sampled_token_ids, list):
        return [list(r) for r in sampled_token_ids]
    return sampled_token_ids.tolist()  # device -> host: one small copy


def ending_requests(runner: Any, scheduler_output: Any,
                    sampled_token_ids: Any) -> tuple[set[str], set[str], bool]:
    """grammar_end.predict_ends for the V1 runner's input batch: a row
    samples unless it is a partial prefill (discard_request_mask)."""
    if not getattr(scheduler_output, "has_structured_output_requests", True):
        return set(), set(), False  # no structured request: stock, O(1)
    batch = list(runner.input_batch.req_ids)  # index = row of sampled tokens
    if not batch or None in batch:
        return set(), set(), False
    discard = getattr(getattr(runner, "discard_request_mask", None), "np", None)

    def params(i: int) -> Any:
        return getattr(runner.requests.get(batch[i]), "sampling_params", None)

    view = grammar_end.BatchView(
        req_ids=batch,
        structured=lambda i: getattr(params(i), "structured_outputs",
                                     None) is not None,
        samples=lambda i: discard is None or not bool(discard[i]),
        stops=lambda i: grammar_end.stop_set(params(i)),
        spec_tokens=scheduler_output.scheduled_spec_decode_tokens,
        num_spec_tokens=int(getattr(runner, "num_spec_tokens", 0) or 0),
        read_sampled=lambda: _sampled_rows(sampled_token_ids),
        known=runner.requests)
    return grammar_end.predict_ends(runner, view,
                                    runner.__dict__.get(_GRAMMAR_ATTR),
                                    grammar_end.reasoning_rows(runner))


def _skip_drafter(runner: Any, sampled_token_ids: Any) -> Any:
    """Stock's own path for "input does not fit in the drafter"
    (GPUModelRunner.sample_tokens, pinned), for the drafters in
    COVERED_DRAFTERS only: zero drafts, no draft probabilities, and with the
    padded drafter batch (GPU sampled tokens) the next step's sampled-token
    inputs prepared without the drafter; a dummy run keeps DP ranks' drafter
    collectives in step. Stock zeroes the host copy of the drafts directly
    (`zeros_only`); here the caller copies the zero tensor: same values."""
    import torch

    runner._draft_probs = None
    if hasattr(runner, "_draft_prob_req_ids"):
        runner._draft_prob_req_ids = None
    if torch.is_tensor(sampled_token_ids) and \
            getattr(runner, "valid_sampled_token_count_event", None) is not None:
        next_token_ids, valid_count = runner.drafter.prepare_next_token_ids_padded(
            sampled_token_ids, runner.requests, runner.input_batch,
            runner.discard_request_mask.gpu)
        runner._copy_valid_sampled_token_count(next_token_ids, valid_count)
    if runner.parallel_config.data_parallel_size > 1:
        # As stock: keep DP ranks' drafter collectives in step.
        runner.drafter.dummy_run(num_tokens=1)
    return torch.zeros(1, device=runner.device, dtype=torch.int32).expand(
        len(runner.input_batch.req_ids), runner.num_spec_tokens)


def _make_propose_draft_token_ids(original: Any) -> Any:
    def propose_draft_token_ids(self: Any, scheduler_output: Any,
                                sampled_token_ids: Any, *args: Any,
                                **kwargs: Any) -> Any:
        if not _eligible(self):
            return original(self, scheduler_output, sampled_token_ids,
                            *args, **kwargs)
        stats = draft_stats(self)
        stats["proposer_calls"] += 1
        before, ending, all_end = ending_requests(self, scheduler_output,
                                                  sampled_token_ids)
        self.__dict__[_DROP_ATTR] = frozenset(before | ending)
        if all_end:
            stats["skipped_calls"] += 1
            stats["skipped_request_drafts"] += len(before) + len(ending)
            return _skip_drafter(self, sampled_token_ids)
        stats["dropped_request_drafts"] += len(before) + len(ending)
        return original(self, scheduler_output, sampled_token_ids,
                        *args, **kwargs)

    return propose_draft_token_ids


def _make_take_draft_token_ids(original: Any) -> Any:
    from vllm_patch.v1.spec_decode import grammar_drafts
    from vllm_patch.v1.spec_decode.grammar_end import withhold_drafts

    def take_draft_token_ids(self: Any) -> Any:
        out = withhold_drafts(original(self), self.__dict__.get(_DROP_ATTR))
        # Grammar-aware drafting: no drafts after a grammar's end (the
        # drafter stopped walking the grammar there).
        drafter = getattr(self, "drafter", None)
        limits = grammar_drafts.take_limits(drafter)
        if limits:
            t = drafter.__dict__.get(grammar_drafts.TRACKER_ATTR)
            out = grammar_drafts.trim_drafts(
                out, limits, t.stats if t is not None else None)
        return out

    return take_draft_token_ids


_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner."
_PIN_SAMPLE_TOKENS = pin(
    _RUNNER + "sample_tokens",
    "applies the grammar bitmask and hands execute_model_state's "
    "spec_decode_metadata to the rejection sampler after sample_tokens "
    "starts; calls propose_draft_token_ids only when the input fits in the "
    "drafter, stores its return as the drafts and copies them to the host; "
    "its not-fits path (zero drafts, no draft probs, "
    "prepare_next_token_ids_padded for GPU sampled tokens, a DP dummy run) "
    "is what _skip_drafter reproduces")


PATCHES: list[Patch] = [
    Patch(
        name="g3-v1-runner-acceptable-drafts",
        guarantee="G3",
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
        versions=("0.32", "0.33"),
        signature=("self", "grammar_output"),
        make=_make_sample_tokens,
        why=("the V1 runner ignores num_acceptable_drafts and, under async "
             "scheduling, verifies its own post-terminal drafts (the "
             "scheduler's -1 padding never reaches it): accepted > drafted"),
        how=("before the stock sample_tokens, drafts at positions >= "
             "num_acceptable_drafts become -1 in spec_decode_metadata, which "
             "the rejection sampler always rejects (as Model Runner V2's "
             "grammar_invalid_drafts). Runner-side because rows alone cannot "
             "do it: a stop token drafted after the terminal passes a "
             "stop-only row; the rows (g3-bitmask-rows) make the token "
             "sampled at the first "
             "unacceptable position grammar-valid"),
        upstream=("vLLM Model Runner V2 grammar_invalid_drafts "
                  "(v1/worker/gpu/structured_outputs.py); SGLang PR #24082"),
        remove_when="the V1 runner reads num_acceptable_drafts (or is removed)",
        pins=(
            _PIN_SAMPLE_TOKENS,
            pin("vllm.v1.sample.rejection_sampler:RejectionSampler.forward",
                "spec_decode_metadata.draft_token_ids is used only as the "
                "rejection sampler's draft input (the -1 written there "
                "reaches nothing else)"),
            pin("vllm.v1.sample.rejection_sampler:rejection_sample",
                "hands draft_token_ids to the greedy / random (and FLy) "
                "kernels, which reject a draft < 0; the Triton kernels "
                "themselves have no inspectable source to pin"),
        ),
    ),
    Patch(
        name="g3-no-drafts-after-grammar-end",
        guarantee="G3",
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
        versions=("0.32", "0.33"),
        signature=("self", "scheduler_output", "sampled_token_ids",
                   "sampling_metadata", "hidden_states", "sample_hidden_states",
                   "aux_hidden_states", "spec_decode_metadata",
                   "common_attn_metadata", "slot_mappings"),
        make=_make_propose_draft_token_ids,
        why=("the V1 runner runs the EAGLE / draft_model drafter (k forward "
             "passes) for requests whose grammar ends in this step, or ended "
             "in the previous one under async scheduling: G2 finishes them, "
             "so those drafts are never used"),
        how=("before the drafter runs: a request has ended if a grammar stop "
             "token (its all_stop_token_ids) was sampled from a grammar-filled "
             "bitmask row (only then does the grammar terminate, and G2 "
             "finishes it; see vllm_patch.v1.spec_decode.grammar_end), or it "
             "ended one step earlier under async scheduling. All ended: skip "
             "the drafter through stock's 'does not fit in the drafter' path "
             "(zero drafts). Some ended: the drafter runs as in stock (no "
             "compute saved), their drafts are not handed over. Sampled tokens "
             "are read only when the bitmask says every request may end. "
             "Drafters skipped: EAGLE / EAGLE3 / MTP (EagleProposer, "
             "Gemma4Proposer, subclasses), DFlash and draft_model, whose "
             "not-fits path is mirrored; never skipped (stock drafting): "
             "extract_hidden_states (its propose caches hidden states for KV "
             "transfer), ngram on the GPU (stock updates its token table "
             "instead), ngram, suffix, medusa, custom proposers, and pipeline "
             "parallel. "
             "Needs g3-v1-runner-acceptable-drafts (it passes grammar_output "
             "in) and G2's commit cut (else nothing is skipped). Runner-side: "
             "only the worker knows the sampled tokens before drafting"),
        upstream=("SGLang PR #24082 (no drafts for finished grammars); vLLM "
                  "has no counterpart"),
        remove_when="vLLM skips drafting for requests finishing in the step",
        pins=(
            _PIN_SAMPLE_TOKENS,
            pin(_RUNNER + "propose_draft_token_ids",
                "its EAGLE / draft-model branch (the COVERED_DRAFTERS) sets "
                "no per-step runner state but the drafts, _draft_probs / "
                "_draft_prob_req_ids and (padded batch) the next step's "
                "sampled-token inputs, which _skip_drafter sets as stock's "
                "not-fits path does"),
            pin("vllm.v1.structured_output:StructuredOutputManager"
                ".grammar_bitmask",
                "bitmask row layout read by grammar_end.request_rows (0.32: "
                "1 + len(drafts) rows packed; 0.33: k + 1 per request) and "
                "reasoning rows (all-ones, minus masked reasoning ends)",
                on_build=True),
            pin("vllm.v1.structured_output:StructuredOutputManager"
                "._create_grammar",
                "grammars are compiled with the request's all_stop_token_ids "
                "as stop tokens (xgrammar), the set grammar_end.stop_set "
                "reads"),
        ),
    ),
    Patch(
        name="g3-no-drafts-handed-over-after-grammar-end",
        guarantee="G3",
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner.take_draft_token_ids",
        versions=("0.32", "0.33"),
        signature=("self",),
        make=_make_take_draft_token_ids,
        why=("drafts proposed for a request whose grammar ended (in a batch "
             "where others go on) reach the scheduler as if usable"),
        how=("requests g3-no-drafts-after-grammar-end found ended in the last "
             "step get an empty draft list; the scheduler then schedules none "
             "(async: pads -1 and num_acceptable_drafts=0)"),
        upstream="SGLang PR #24082",
        remove_when="with g3-no-drafts-after-grammar-end",
        pins=(
            pin("vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids",
                "an empty draft list leaves the request without spec tokens"),
            pin("vllm.v1.core.sched.scheduler:Scheduler"
                ".update_draft_token_ids_in_output",
                "an empty draft list is padded with -1 to the scheduled count "
                "(no acceptable drafts)"),
        ),
    ),
]
