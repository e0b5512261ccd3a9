#!/usr/bin/env bash
# A long soak campaign: the production-mix stream (vllm_patch.testing.soak)
# through several one-server configurations in turn, each a fixed number of
# requests, so that a rerun with the same OUT resumes where it stopped (the
# soak skips request ids already recorded; a finished leg costs one server
# start to confirm). Progress is printed every 10 s by the soak itself.
#
#   benchmarks/soak_campaign.sh patched /tmp/campaign 4000
#   benchmarks/soak_campaign.sh stock   /tmp/campaign 500    # a stock prefix
#   python -m vllm_patch.testing.soak diff /tmp/campaign/stock-<leg> /tmp/campaign/patched-<leg>
#
# Arguments: mode (patched|stock), output folder, requests per leg (default
# 4000). LEGS overrides the legs ("backend:spec:sched ..."). Extra soak
# options can be given in SOAK_ARGS (for example "--max-tokens-cap 64").
set -euo pipefail
mode=${1:?usage: soak_campaign.sh patched|stock OUT [REQUESTS]}
out=${2:?usage: soak_campaign.sh patched|stock OUT [REQUESTS]}
requests=${3:-4000}
case $mode in patched|stock) ;; *) echo "mode must be patched or stock, not '$mode'" >&2; exit 2 ;; esac
legs=${LEGS:-"xgrammar:eagle:async guidance:draft_model:async xgrammar:draft_model:sync guidance:eagle:sync"}
mkdir -p "$out"
for leg in $legs; do
  IFS=: read -r backend spec sched <<<"$leg"
  dir="$out/$mode-$backend-$spec-$sched"
  echo "== leg $backend / $spec / $sched ($mode): $requests requests -> $dir"
  start=$(date +%s)
  # shellcheck disable=SC2086
  python -m vllm_patch.testing.soak run --mode "$mode" --out "$dir" \
    --backend "$backend" --spec "$spec" --sched "$sched" --requests "$requests" \
    ${SOAK_ARGS:-} || echo "== leg $leg ended with status $? (see $dir)"
  echo "== leg $leg done in $(( $(date +%s) - start )) s"
done
