"""`vllm-patch status | verify | build-model | launch | demo`."""

from __future__ import annotations

import argparse
import json
import sys


def _status(args: argparse.Namespace) -> int:
    import vllm_patch
    from vllm_patch import envs, patching

    vllm_patch.register()
    settings = envs.settings()
    rows = patching.guarantee_table(settings)
    others = [
        patching.patch_row(o)
        for o in patching.REGISTRY.outcomes.values()
        if o.patch.guarantee in patching.NON_GUARANTEE_IDS
    ]
    report = {
        "vllm_patch": vllm_patch.__version__,
        "vllm": patching.vllm_version(),
        "disabled": settings.disable,
        "strict": settings.strict,
        "strict_runtime": settings.strict_runtime,
        "model_runner": patching.selected_runner(),
        "guarantees": rows,
        "other_patches": others,
        "module_errors": {m: err for m, (_, err)
                          in patching.REGISTRY.module_errors.items()},
        "features": _features(settings),
    }
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    print(f"vllm_patch {report['vllm_patch']} on vLLM {report['vllm']}"
          + ("  [VLLM_PATCH_DISABLE=1]" if settings.disable else ""))
    chosen = report["model_runner"]
    print(f"model runner: {chosen['runner'] or 'V1 or V2'} "
          f"(decided by {chosen['decided_by']})")
    print(f"{'id':<4} {'status':<13} guarantee")
    for row in rows:
        print(f"{row['guarantee']:<4} {row['status']:<13} {row['text']}")
        if row["reason"]:
            print(f"{'':<18}({row['reason']})")
        if row["implementation"]:
            print(f"{'':<18}implementation: {row['implementation']}")
        for limit in row.get("limits", ()):
            print(f"{'':<18}limit: {limit}")
        for runner, r in row.get("runners", {}).items():
            print(f"{'':<18}{runner} runner: {r['status']}"
                  + (f" ({r['reason']})" if r["reason"]
                     and r["reason"] != row["reason"] else ""))
            if r["native"]:
                print(f"{'':<20}native: {r['native']}")
            for limit in r["limits"]:
                print(f"{'':<20}limit: {limit}")
        for p in row["patches"]:
            _print_patch(p, args.verbose)
    for f in report["features"]:
        print(f"grammar-aware drafting, {f['feature']}: {f['status']}"
              + (f" ({f['reason']})" if f["reason"] else ""))
    for p in others:
        _print_patch(p, args.verbose, prefix=f"[{p['guarantee']}] ")
    for module, err in report["module_errors"].items():
        print(f"patch module {module} failed to import: {err}")
    return 0


def _features(settings) -> list[dict]:
    """Status of the package's optional features (on / off by switch / not
    active and why)."""
    from vllm_patch.v1.spec_decode.grammar_drafts import feature_status
    from vllm_patch.v1.worker.gpu.spec_decode import speculator as v2

    return feature_status(settings) + v2.feature_status(settings)


def _print_patch(p: dict, verbose: bool, prefix: str = "") -> None:
    indent = " " * 18 if not prefix else ""
    print(f"{indent}{prefix or '- '}{p['name']}: {p['state']}"
          + (f" ({p['detail']})" if p["detail"] else ""))
    if not verbose:
        return
    pad = " " * (22 if not prefix else 4)
    extra = {"implementation": p["implementation"] or "-",
             "defined_in": p["defined_in"]}
    if "objects" in p:
        extra["objects wrapped"] = p["objects"]
    if p["source_drift"]:
        extra["source drift (fallback in use)"] = p["source_drift"]
    for key, value in extra.items():
        print(f"{pad}{key}: {value}")
    for key in ("target", "versions", "pins", "why", "how", "upstream",
                "remove_when"):
        print(f"{pad}{key}: {p[key]}")


def _verify(args: argparse.Namespace) -> int:
    from vllm_patch.conformance import verify

    return verify.verify(args)


def _build_model(args: argparse.Namespace) -> int:
    from vllm_patch.testing import tiny_model

    print(tiny_model.build_target())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-patch", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("status", help="guarantees G1-G4 on the installed vLLM")
    p.add_argument("--json", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print each patch's full record: live implementation, "
                   "where it is defined, its target and pinned vLLM source")
    p.set_defaults(func=_status)
    from vllm_patch.conformance import GUARANTEE_IDS, verify

    p = sub.add_parser(
        "verify",
        help="run the conformance scenarios stock and patched; "
             "non-zero exit if a guarantee fails when patched",
        description=verify.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--guarantee", action="append", default=[],
                   choices=GUARANTEE_IDS, help="only this guarantee (repeatable)")
    p.add_argument("-k", dest="keyword", action="append", default=[],
                   metavar="NAME", help="only scenarios whose name contains NAME "
                   "(repeatable)")
    p.add_argument("--json", action="store_true", help="print a JSON report")
    p.add_argument("--timeout", type=float, default=verify.DEFAULT_TIMEOUT,
                   help="seconds allowed per run (stock, patched); "
                   "default %(default)g")
    p.add_argument("--allow-empty", action="store_true",
                   help="exit 0 when no scenario ran (default: exit 4)")
    p.add_argument("--module", action="append", default=None,
                   help="scenario module to run instead of the shipped ones "
                   "(repeatable; for testing your own scenarios)")
    p.set_defaults(func=_verify)
    p = sub.add_parser("build-model", help="build (or find) the tiny local model")
    p.set_defaults(func=_build_model)
    from vllm_patch.launch import command, demo

    command.add_parser(sub)
    demo.add_parser(sub)
    from vllm_patch import series

    series.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
