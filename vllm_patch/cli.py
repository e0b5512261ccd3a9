"""`vllm-patch status | verify | build-model`."""

from __future__ import annotations

import argparse
import json
import sys


def _status(args: argparse.Namespace) -> int:
    import vllm_patch
    from vllm_patch import envs, patching

    vllm_patch.register()
    rows = patching.guarantee_table()
    settings = envs.settings()
    others = [
        {**o.patch.record(), "state": o.state.value, "detail": o.detail}
        for o in patching.REGISTRY.outcomes.values()
        if o.patch.guarantee in patching.NON_GUARANTEE_IDS
    ]
    report = {
        "vllm_patch": vllm_patch.__version__,
        "vllm": patching.vllm_version(),
        "disabled": settings.disable,
        "strict": settings.strict,
        "guarantees": rows,
        "other_patches": others,
    }
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    print(f"vllm_patch {report['vllm_patch']} on vLLM {report['vllm']}"
          + ("  [VLLM_PATCH_DISABLE=1]" if settings.disable else ""))
    print(f"{'id':<4} {'status':<13} guarantee")
    for row in rows:
        print(f"{row['guarantee']:<4} {row['status']:<13} {row['text']}")
        if row["reason"]:
            print(f"{'':<18}({row['reason']})")
        for p in row["patches"]:
            print(f"{'':<18}- {p['name']}: {p['state']}"
                  + (f" ({p['detail']})" if p["detail"] else ""))
            if args.verbose:
                for key in ("target", "versions", "why", "how", "upstream",
                            "remove_when"):
                    print(f"{'':<22}{key}: {p[key]}")
    for p in others:
        print(f"[{p['guarantee']}] {p['name']}: {p['state']}")
    return 0


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
                   help="print each patch's full record")
    p.set_defaults(func=_status)
    p = sub.add_parser("build-model", help="build (or find) the tiny local model")
    p.set_defaults(func=_build_model)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
