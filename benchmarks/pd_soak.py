"""Soak a real P/D pair with the structured workload, batch after batch, and
catch stalls: how the NIXL "stall" of issue 6 was found.

One pair (vllm_patch.testing.pd_pair.PDPair, tiny model, `draft_model` k=3, async
scheduling by the test switch) serves the 64-request batch of
vllm_patch.testing.workload `--rounds` times (fresh prompts each round). A
watchdog notes when no request has finished for `--stall-s` seconds and
then, once per round, writes `py-spy dump` of every process of both
servers' process groups to `--out` (py-spy optional: `pip install py-spy`).
Each round prints its wall time and whether it stalled; the servers' logs
are kept in `--out`.

    python benchmarks/pd_soak.py --mode stock --rounds 5
    # the pinning that caused the stall, switch off (expect stalls, even
    # EngineDeadError on the 2-core machine):
    python benchmarks/pd_soak.py --mode stock --rounds 5 --vllm-nixl-pinning
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def group_pids(pgid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "-g", str(pgid)], capture_output=True,
                         text=True).stdout
    return [int(x) for x in out.split()]


def dump_stacks(pd, out_dir: str, tag: str) -> None:
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        print(f"  (py-spy not installed: no stack dump for {tag})", flush=True)
        return
    for role in ("prefill", "decode"):
        for pid in group_pids(pd.server(role).pgid):
            r = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True,
                               text=True, timeout=60)
            with open(os.path.join(out_dir, f"stacks-{tag}-{role}-{pid}.txt"), "w") as f:
                f.write(r.stdout + r.stderr)
    print(f"  stacks written to {out_dir}/stacks-{tag}-*", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("stock", "patched"), default="stock")
    ap.add_argument("--connector", choices=("NixlConnector", "ExampleConnector"),
                    default="NixlConnector")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stall-s", type=float, default=25.0)
    ap.add_argument("--sync", action="store_true", help="no async scheduling switch")
    ap.add_argument("--vllm-nixl-pinning", action="store_true",
                    help="leave NixlConnector's CPU core pinning as vLLM does it")
    ap.add_argument("--out", default=None, help="logs and stack dumps (default: a tmp dir)")
    a = ap.parse_args()
    for var in ("VLLM_PATCH_DISABLE", "VLLM_PATCH_SKIP"):
        if os.environ.get(var):
            sys.exit(f"run without {var}: use --mode")

    from vllm_patch.testing import workload as wl
    from vllm_patch.testing.pd_pair import PDConfig, PDPair

    out = a.out or tempfile.mkdtemp(prefix="pd-soak-")
    os.makedirs(out, exist_ok=True)
    storage = os.path.join(out, "storage")
    if a.connector == "NixlConnector":
        cfg = PDConfig.nixl(storage, spec_k=3, force_async=not a.sync)
        if a.vllm_nixl_pinning:
            cfg.env["VLLM_PATCH_NIXL_CPU_CORE_IN_BIND"] = "0"
    else:
        cfg = PDConfig(storage=storage, spec_k=3, force_async=not a.sync)
    if a.mode == "stock":
        cfg.env["VLLM_PATCH_DISABLE"] = "1"
    cfg.log_dir = out
    print(f"{a.mode} {a.connector} {'sync' if a.sync else 'async'}"
          f"{', vLLM NIXL pinning' if a.vllm_nixl_pinning else ''}; output in {out}",
          flush=True)
    with PDPair(cfg) as pd:
        print(f"pair up in {pd.start_s:.0f}s", flush=True)
        for rnd in range(a.rounds):
            reqs = wl.build_requests()
            for r in reqs:
                r["i"] += 10_000 * (rnd + 1)
            done, last = [0], [time.monotonic()]
            stalled = threading.Event()
            stop = threading.Event()

            def send(r: dict) -> dict:
                o = wl.send(pd.url, r)
                done[0] += 1
                last[0] = time.monotonic()
                return o

            def watch() -> None:
                while not stop.wait(2):
                    idle = time.monotonic() - last[0]
                    if not stalled.is_set() and idle > a.stall_s:
                        stalled.set()
                        print(f"  round {rnd}: STALL, {done[0]}/{len(reqs)} done, "
                              f"{idle:.0f}s without a finished request", flush=True)
                        dump_stacks(pd, out, f"r{rnd}")

            w = threading.Thread(target=watch, daemon=True)
            w.start()
            t0 = time.monotonic()
            try:
                with cf.ThreadPoolExecutor(8) as ex:
                    outs = list(ex.map(send, reqs))
            finally:
                stop.set()
            valid = sum(wl.valid(r["kind"], o["text"]) for r, o in zip(reqs, outs))
            print(f"round {rnd}: {time.monotonic() - t0:.1f}s, valid {valid}/{len(reqs)}, "
                  f"stalled={stalled.is_set()}", flush=True)


if __name__ == "__main__":
    main()
