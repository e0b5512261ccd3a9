"""Child process for tests/test_patch_release.py: simulate a vLLM patch
release or a bug in a patch, then let vLLM load its plugins as it does at
start-up, and report what happened (JSON on the last stdout line).

    python patch_release_child.py signature|raising|broken-module scheduler|engine
"""

from __future__ import annotations

import dataclasses
import json
import sys


def simulate(kind: str) -> None:
    import vllm_patch

    if kind == "signature":
        # A patch release adds a parameter to a method G2 wraps.
        from vllm.v1.core.sched.scheduler import Scheduler

        stock = Scheduler._update_request_with_output

        def _update_request_with_output(self, request, new_token_ids,
                                        is_stale=False, trace=None):
            return stock(self, request, new_token_ids, is_stale)

        Scheduler._update_request_with_output = _update_request_with_output
    elif kind == "raising":
        # A bug in one G3 patch's make().
        from vllm_patch.v1.structured_output import g3_rows

        def make(original):
            raise RuntimeError("simulated bug in a patch")

        g3_rows.PATCHES[0] = dataclasses.replace(g3_rows.PATCHES[0], make=make)
    elif kind == "broken-module":
        # A G4 patch module that cannot even be imported.
        sys.modules["vllm_patch_test_broken"] = None  # import raises ImportError
        vllm_patch.PATCH_MODULES["vllm_patch_test_broken"] = ("G4",)
    else:
        raise SystemExit(f"unknown simulation {kind!r}")


def run_scheduler() -> dict:
    """vLLM's plugin loader, then a real scheduler serving a structured
    request to its end."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm_patch.testing.harness import Harness

    h = Harness("xgrammar", num_spec_tokens=3)
    a, b = h.tok("a"), h.tok("b")
    rid = h.add_request(regex="ab", max_tokens=8)
    h.step({rid: [a]})
    h.step({rid: [b]})
    h.step({rid: [h.tokenizer.eos_token_id]})
    return {"finish": h.emitted(rid).finish_reason,
            "tokens": h.emitted(rid).token_ids, "expect": [a, b]}


def run_engine() -> dict:
    """A real in-process engine: vLLM loads the plugin while it starts."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_patch.testing import engine

    llm = engine.start_llm()
    try:
        out = llm.generate(["x y"], SamplingParams(
            temperature=0, max_tokens=16,
            structured_outputs=StructuredOutputsParams(regex="ab")),
            use_tqdm=False)[0].outputs[0]
        return {"finish": out.finish_reason, "text": out.text}
    finally:
        engine.stop_llm(llm)


def main() -> None:
    kind, where = sys.argv[1], sys.argv[2]
    simulate(kind)
    served = run_scheduler() if where == "scheduler" else run_engine()
    from vllm_patch import patching

    # What the classes hold now: the attribute each registered patch targets.
    live = {}
    for name, patch in patching.REGISTRY.patches.items():
        if patch.per_instance or patch.new_attribute:
            continue
        try:
            owner = patching.resolve_target(patch.target.rsplit(".", 1)[0])
            attr = getattr(owner, patch.attr_path[-1])
        except LookupError:
            continue
        live[name] = getattr(attr, patching.NAME_ATTR, None)
    print(json.dumps({
        "served": served,
        "status": patching.guarantee_table(),
        "live": live,
        "states": {n: o.state.value for n, o in patching.REGISTRY.outcomes.items()},
    }))


if __name__ == "__main__":
    main()
