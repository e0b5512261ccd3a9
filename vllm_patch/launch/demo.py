"""`vllm-patch demo`: stock vs patched, side by side, on a real P/D deployment.

1. builds (or finds) the tiny local model (no download);
2. starts a local Ray cluster and, with the launcher, a P/D deployment of two
   real vLLM OpenAI servers (prefill `kv_producer`, decode `kv_consumer`,
   ExampleConnector over a temp dir, `draft_model` speculative decoding with
   k=3, xgrammar, async scheduling kept on with the TEST-ONLY switch
   VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING because the CPU platform turns it off)
   and the router; first stock (VLLM_PATCH_DISABLE=1 on both servers), then
   patched;
3. sends each the same structured workload through the router (JSON schemas,
   choice, regex; completions and chat; ignore_eos true and false; streaming
   and not) and checks every answer;
4. prints the table: valid outputs, tokens after the grammar's end, finish
   reasons, spec-decode accepted vs drafted tokens, KV blocks held at idle,
   start-up and workload wall time (`--markdown`: as the README's Markdown
   table, with the vLLM version and settings it was made with).

The servers' logs are removed with the deployments, except when a deployment
fails (a progress line then says where they are) or with `--log-dir DIR`
(kept in DIR/stock and DIR/patched).

Exit code 0 when the patched deployment holds (every output valid, nothing
after the grammar's end, no KV block held at idle), 1 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import secrets
import tempfile
import time
import urllib.request
from typing import Any

MODES = ("stock", "patched")

logger = logging.getLogger(__name__)


def blocks_in_use(dep: Any, role: str) -> int:
    """KV blocks held = usage fraction x pool size (vllm:cache_config_info)."""
    held = 0
    for inst in dep.role_instances(role):
        with urllib.request.urlopen(inst.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        usage = re.search(r"^vllm:kv_cache_usage_perc(?:\{[^}]*\})? (\S+)$", text, re.M)
        size = re.search(r'num_gpu_blocks="(\d+)"', text)
        if usage and size:
            held += round(float(usage.group(1)) * int(size.group(1)))
    return held


def launch_config(mode: str, model: str, workdir: str, spec_k: int,
                  log_dir: str | None = None) -> Any:
    """One mode's deployment. Its logs go to `log_dir`/`mode` when given
    (kept), else to the deployment's own folder (kept only if it fails):
    never into `workdir`, which is removed when the demo ends."""
    from vllm_patch.launch.config import LaunchConfig
    from vllm_patch.testing.pd_pair import tiny_vllm_args

    return LaunchConfig(
        model=model, served_model_name="tiny", connector="ExampleConnector",
        kv_connector_extra_config={"shared_storage_path": f"{workdir}/{mode}-kv"},
        vllm_args=tiny_vllm_args(model, spec_k=spec_k),
        env={"VLLM_PATCH_DISABLE": "1" if mode == "stock" else "0",
             "VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING": "1",
             "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"},
        router={"host": "127.0.0.1", "port": 0}, max_restarts=0,
        log_dir=os.path.join(os.path.abspath(log_dir), mode) if log_dir else None,
        start_timeout_s=300)


def run_mode(mode: str, model: str, workdir: str, requests: list[dict],
             spec_k: int, log_dir: str | None = None) -> dict[str, Any]:
    from vllm_patch.launch.deployment import Deployment
    from vllm_patch.testing import workload as wl

    cfg = launch_config(mode, model, workdir, spec_k, log_dir)
    # the launcher keeps its KV files in a subfolder of this one, which
    # must exist (it never creates a shared_storage_path itself)
    os.makedirs(cfg.kv_connector_extra_config["shared_storage_path"], exist_ok=True)
    logger.info("== %s: launching prefill + decode (%s)", mode,
                "VLLM_PATCH_DISABLE=1" if mode == "stock" else "plugin active")
    t0 = time.monotonic()
    with Deployment(cfg) as dep:
        startup = time.monotonic() - t0
        logger.info("sending %d structured requests through %s", len(requests),
                    dep.url)
        res = wl.run_batch(dep, requests)
        held = {role: blocks_in_use(dep, role) for role in ("prefill", "decode")}
    c, d = res["counts"], res["delta"]
    return {
        "mode": mode, "n": len(requests), "valid": c["valid"],
        "post": c["post_grammar_tokens"],
        "stop": c["finish_stop"], "length": c["finish_length"],
        "drafted": int(d.get("vllm:spec_decode_num_draft_tokens_total", 0)),
        "accepted": int(d.get("vllm:spec_decode_num_accepted_tokens_total", 0)),
        "held": held, "startup": startup, "wall": res["wall"],
        "failing": res["problems"][True] + res["problems"][False],
    }


def table(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    """The side-by-side table: aligned text, or Markdown (the README's)."""
    head = ["", *(r["mode"] for r in rows)]
    lines = [
        ("valid structured outputs", [f"{r['valid']} / {r['n']}" for r in rows]),
        ("tokens after the grammar's end", [str(r["post"]) for r in rows]),
        ("finish reason stop / length", [f"{r['stop']} / {r['length']}" for r in rows]),
        ("spec decode accepted / drafted", [f"{r['accepted']} / {r['drafted']}"
                                            for r in rows]),
        ("KV blocks held at idle (P, D)", [f"{r['held']['prefill']}, {r['held']['decode']}"
                                           for r in rows]),
        ("start-up s / workload s", [f"{r['startup']:.0f} / {r['wall']:.0f}" for r in rows]),
    ]
    if markdown:
        row = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
        return "\n".join([row(head), row(["---"] * len(head))]
                         + [row([k, *v]) for k, v in lines])
    w0 = max(len(k) for k, _ in lines)
    ws = [max(len(head[i + 1]), *(len(v[i]) for _, v in lines)) for i in range(len(rows))]
    fmt = lambda cells: "  ".join(  # noqa: E731
        [cells[0].ljust(w0)] + [c.rjust(w) for c, w in zip(cells[1:], ws)])
    return "\n".join([fmt(head), fmt(["-" * w0] + ["-" * w for w in ws])]
                     + [fmt([k, *v]) for k, v in lines])


def holds(row: dict[str, Any]) -> bool:
    return (row["valid"] == row["n"] and row["post"] == 0
            and row["held"] == {"prefill": 0, "decode": 0})


def keep_ray_token_in(workdir: str) -> None:
    """The demo's local Ray cluster gets its own token in the work dir
    (removed with it), not ~/.ray/auth_token (see
    vllm_patch.launch.deployment.own_ray_token); a token or mode the user
    configured is left alone."""
    from vllm_patch.launch.deployment import own_ray_token

    own_ray_token(workdir)


def main(args: argparse.Namespace) -> int:
    import ray

    from vllm_patch.launch import show_progress
    from vllm_patch.launch.command import handle_stop_signals
    from vllm_patch.launch.deployment import ray_folder, remove_ray_folder
    from vllm_patch.testing import workload as wl
    from vllm_patch.testing import tiny_model

    show_progress()
    handle_stop_signals()
    t0 = time.monotonic()
    logger.info("building (or finding) the tiny local model")
    model = str(tiny_model.build_target())
    requests = wl.build_requests()[:args.requests] if args.requests else wl.build_requests()
    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm-patch-demo-") as workdir:
        # Ray's files in a short folder of their own (its socket paths must
        # fit in 107 bytes whatever TMPDIR is), removed at the end
        ray_dir = ray_folder(secrets.token_hex(4))
        logger.info("starting a local Ray cluster (its files in %s)", ray_dir)
        keep_ray_token_in(workdir)
        try:
            # ray.init sets its own SIGTERM handler: put ours back
            ray.init(address="local", include_dashboard=False, log_to_driver=False,
                     _temp_dir=ray_dir)
            handle_stop_signals()
            for mode in args.modes:
                rows.append(run_mode(mode, model, workdir, requests, args.spec_k,
                                     args.log_dir))
        finally:
            ray.shutdown()
            remove_ray_folder(ray_dir)
    import vllm

    print()
    print(f"P/D on Ray (prefill + decode, ExampleConnector), vLLM {vllm.__version__}, "
          f"tiny model, {len(requests)} requests, draft_model k={args.spec_k}, xgrammar, "
          "async scheduling (forced on the CPU: test-only switch)")
    print(table(rows, markdown=args.markdown))
    if args.log_dir:
        print("servers' logs kept: " + ", ".join(
            os.path.join(os.path.abspath(args.log_dir), m) for m in args.modes))
    for r in rows:
        if r["mode"] == "stock" and r["failing"]:
            print(f"stock, first failing request: {r['failing'][0][:300]}")
    print(f"total {time.monotonic() - t0:.0f} s")
    patched = [r for r in rows if r["mode"] == "patched"]
    if patched and not holds(patched[0]):
        print("PATCHED DEPLOYMENT DOES NOT HOLD G1-G4:", *patched[0]["failing"][:5], sep="\n  ")
        return 1
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="stock vs patched on a local P/D deployment "
                       "(tiny model, spec decode, structured outputs)",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=0,
                   help="send only the first N requests of the workload (default: all 64)")
    p.add_argument("--spec-k", type=int, default=3, help="draft tokens per step")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--markdown", action="store_true",
                   help="print the table in Markdown (as in the README)")
    p.add_argument("--log-dir", metavar="DIR",
                   help="keep the servers' logs in DIR/stock and DIR/patched (default: "
                        "removed with the deployments, kept only when one fails)")
    p.set_defaults(func=main)
