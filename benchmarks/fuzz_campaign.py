"""Long fuzz campaign (issue 8): episodes run and violations per property,
patched and stock, on the installed vLLM (choose the version with the venv /
PYTHONPATH, as for the tests).

    nice -n 15 timeout 3600 python benchmarks/fuzz_campaign.py \\
        --episodes 20000 --mode patched --state /tmp/fuzz-032-patched.json
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=$HOME/.cache/vllm-patch/vllm-0.33.0 \\
        nice -n 15 timeout 3600 python benchmarks/fuzz_campaign.py \\
        --episodes 20000 --mode patched --state /tmp/fuzz-033-patched.json

Each mode runs in its own worker process (stock: VLLM_PATCH_DISABLE=1).
Episodes come from `vllm_patch.testing.fuzz.episodes()` (hypothesis, no
shrinking) in chunks of `--chunk` episodes; chunk i is generated with the
hypothesis seed `--seed` * 1000003 + i, so a campaign is reproducible and
resumable:

- progress: one line per chunk on stderr (episodes, rate, violating
  episodes per property, ETA);
- `--state FILE` (one per mode: FILE gets a `-patched` / `-stock` suffix
  with `--mode both`): the counters, the next chunk and how much of it is
  done are written after every chunk and on Ctrl-C / SIGTERM (`timeout`);
  a rerun with the same `--state` continues where it stopped (the partial
  chunk's done episodes are skipped: hypothesis regenerates them from the
  seed);
- `--until HH:MM` (UTC) or `--seconds N`: stop cleanly after the episode
  running at that time; partial results are always reported;
- `--drafts grammar`: the drafts the scheduler sees come from grammar-aware
  drafting's own code (`vllm_patch.testing.fuzz`, draft sources);
- every violating episode is appended to FILE.violations.jsonl (property,
  request, detail, the `EpisodeSpec` repr: `eval` it in the namespace of
  `vllm_patch.testing.fuzz` and pass it to `run_episode` to replay).
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time


class _Stop(Exception):
    pass


def _deadline(until: str | None, seconds: float | None) -> float | None:
    ends = []
    if seconds:
        ends.append(time.time() + seconds)
    if until:
        now = dt.datetime.now(dt.timezone.utc)
        hh, mm = (int(x) for x in until.split(":"))
        t = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
        if t <= now:
            t += dt.timedelta(days=1)
        ends.append(t.timestamp())
    return min(ends) if ends else None


def _load(path: str | None) -> dict:
    if path and os.path.exists(path):
        with open(path) as fh:
            return json.load(fh)
    return {}


def _save(path: str | None, state: dict) -> None:
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(state, fh, indent=1, sort_keys=True)
    os.replace(tmp, path)


def worker(a: argparse.Namespace) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import logging

    import vllm_patch

    vllm_patch.register()
    logging.getLogger("vllm_patch").setLevel(logging.CRITICAL)
    logging.getLogger("vllm").setLevel(logging.CRITICAL)
    from hypothesis import HealthCheck, Phase, given, seed, settings

    from vllm_patch.patching import vllm_version
    from vllm_patch.testing import fuzz

    mode = "stock" if os.environ.get("VLLM_PATCH_DISABLE") == "1" else "patched"
    st = _load(a.state)
    if st and (st.get("vllm") != vllm_version() or st.get("mode") != mode
               or st.get("seed") != a.seed or st.get("chunk") != a.chunk
               or st.get("drafts", "random") != a.drafts):
        sys.exit(f"--state {a.state} belongs to another campaign "
                 f"({st.get('vllm')} {st.get('mode')} seed {st.get('seed')} "
                 f"chunk {st.get('chunk')} drafts "
                 f"{st.get('drafts', 'random')})")
    st = st or {"vllm": vllm_version(), "mode": mode, "seed": a.seed,
                "chunk": a.chunk, "drafts": a.drafts, "episodes": 0,
                "violating_episodes": 0, "draft_stats": {},
                "steps": 0, "seconds": 0.0, "next_chunk": 0, "chunk_done": 0,
                "episodes_violating_property": {}, "examples": []}
    per_prop = collections.Counter(st["episodes_violating_property"])
    vlog = (a.state + ".violations.jsonl") if a.state else None
    end = _deadline(a.until, a.seconds)
    label = f"[{st['vllm']} {mode}]"
    t0 = time.time()
    secs0 = st["seconds"]
    stopping = {"why": None}

    # Only a flag: an exception raised from a signal handler can land in a
    # weakref callback or a C extension and be swallowed. The next episode
    # sees the flag and the campaign stops, flushed.
    def on_signal(signum, frame):  # noqa: ARG001
        stopping["why"] = signal.Signals(signum).name

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def flush() -> None:
        st["episodes_violating_property"] = dict(per_prop)
        st["seconds"] = round(secs0 + time.time() - t0, 1)
        _save(a.state, st)

    def progress() -> None:
        el = time.time() - t0
        done_now = st["episodes"] - start_episodes
        rate = done_now / el if el > 0 else 0.0
        left = max(a.episodes - st["episodes"], 0)
        eta = f"{left / rate / 60:.0f} min" if rate > 0 else "?"
        print(f"{label} {st['episodes']}/{a.episodes} episodes, "
              f"{rate:.2f}/s, {st['violating_episodes']} violating "
              f"{dict(per_prop)}, eta {eta}", file=sys.stderr, flush=True)

    start_episodes = st["episodes"]

    def run_chunk(index: int, skip: int, n: int) -> None:
        seen = [0]

        @seed(a.seed * 1000003 + index)
        @settings(max_examples=n, deadline=None, database=None,
                  phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(fuzz.episodes(a.drafts))
        def run(spec: fuzz.EpisodeSpec) -> None:
            seen[0] += 1
            if seen[0] <= skip:
                return
            if stopping["why"] is not None:
                raise _Stop(stopping["why"])
            if end is not None and time.time() > end:
                raise _Stop("deadline")
            r = fuzz.run_episode(spec)
            st["episodes"] += 1
            st["steps"] += r.steps
            if r.draft_stats:
                ds = collections.Counter(st.setdefault("draft_stats", {}))
                ds.update(r.draft_stats)
                st["draft_stats"] = dict(ds)
            st["chunk_done"] += 1
            props = r.properties()
            if props:
                st["violating_episodes"] += 1
                per_prop.update(props)
                v = r.violations[0]
                if len(st["examples"]) < a.show:
                    st["examples"].append(
                        f"{v.invariant} {v.request_id}: {v.detail}\n"
                        f"    {fuzz.describe(spec)}")
                if vlog:
                    with open(vlog, "a") as fh:
                        fh.write(json.dumps({
                            "properties": sorted(props),
                            "violations": [[x.invariant, x.request_id, x.detail]
                                           for x in r.violations[:10]],
                            "state": str(v.state)[:2000],
                            "spec": fuzz.describe(spec)}) + "\n")

        run()

    why = "done"
    try:
        while st["episodes"] < a.episodes:
            done = st["chunk_done"]
            n = min(a.chunk, a.episodes - st["episodes"] + done)
            run_chunk(st["next_chunk"], done, n)
            st["next_chunk"] += 1
            st["chunk_done"] = 0
            flush()
            progress()
    except _Stop as stop:
        why = str(stop)
    except KeyboardInterrupt:
        why = "interrupted"
    flush()
    progress()
    print(json.dumps({**st, "stopped": why}), flush=True)


def report(res: dict) -> None:
    print(f"vLLM {res['vllm']} {res['mode']}, "
          f"{res.get('drafts', 'random')} drafts: {res['episodes']} episodes "
          f"({res['steps']} engine steps, {res['seconds']} s; "
          f"stopped: {res.get('stopped')}), "
          f"{res['violating_episodes']} with a violation")
    for p, n in sorted(res["episodes_violating_property"].items()):
        print(f"    {p}: {n} episodes")
    ds = res.get("draft_stats") or {}
    if ds:
        keys = ("propose_calls", "positions", "masked_changed", "forced",
                "forced_ahead", "forced_ahead_accepted", "ended",
                "drafts_trimmed", "shadows", "shadows_lost",
                "xgr_batch_accept_calls", "xgr_batch_rollback_calls",
                "xgr_flags_slow")
        print("    grammar-aware drafting: " + ", ".join(
            f"{k} {ds.get(k, 0)}" for k in keys))
    for ex in res["examples"]:
        print("  e.g.", ex[:1500])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=2000,
                    help="episodes per mode (a resumed campaign counts the "
                         "ones already done)")
    ap.add_argument("--mode", choices=["patched", "stock", "both"], default="both")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=100)
    ap.add_argument("--state", default=None, help="state file (resumable)")
    ap.add_argument("--until", default=None, help="HH:MM UTC: stop then")
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--show", type=int, default=3)
    ap.add_argument("--drafts", choices=["random", "grammar"],
                    default="random",
                    help="draft source: the simulated drafter's random "
                         "drafts, or grammar-aware drafting's own code "
                         "(masked / forced drafts, forced continuation; "
                         "JSONSchemaBench schemas too)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    modes = ["patched", "stock"] if a.mode == "both" else [a.mode]
    # The workers get SIGINT / SIGTERM themselves (same process group) and
    # write their partial results; the parent waits for them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    end = _deadline(a.until, a.seconds)
    for mode in modes:
        env = dict(os.environ)
        env.pop("VLLM_PATCH_DISABLE", None)
        if mode == "stock":
            env["VLLM_PATCH_DISABLE"] = "1"
        cmd = [sys.executable, __file__, "--worker", "--episodes",
               str(a.episodes), "--show", str(a.show), "--seed", str(a.seed),
               "--chunk", str(a.chunk), "--drafts", a.drafts]
        if a.state:
            state = a.state if len(modes) == 1 else f"{a.state}-{mode}"
            cmd += ["--state", state]
        if end is not None:
            cmd += ["--seconds", str(max(end - time.time(), 1.0))]
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, text=True,
            preexec_fn=lambda: (signal.signal(signal.SIGINT, signal.SIG_DFL),
                                signal.signal(signal.SIGTERM, signal.SIG_DFL)))
        out, _ = proc.communicate()
        line = [ln for ln in out.splitlines() if ln.startswith("{")]
        if not line:
            print(f"{mode}: worker failed (exit {proc.returncode})")
            continue
        report(json.loads(line[-1]))


if __name__ == "__main__":
    main()
