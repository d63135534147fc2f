#!/usr/bin/env bash
# One device call of benchmarks/recipe_at_scale.py (issue 25), run from the root of the checkout that travels:
#
#   bash benchmarks/recipe_at_scale_device.sh "STAGES" [recipe_at_scale.py options]
#   e.g. "generate tokens"  |  "train --runs paper"  |  "train evaluate --runs no-weighting@sub,layers-3@sub"
#
# carry: .device/scale/kit/data, .device/scale/kit/whl (+ .device/scale/kit/whl-peers for the peers' stages) and
# this call's payload .device/scale/in-K (GGUF parts and/or the last bundle's parts: `recipe_at_scale.py carry`
# writes the folders and prints each call's carry list). Every call: install the wheels, gather the payload
# (parts aside into $W/in, complete sets joined, a newer bundle unpacked), import the target once the GGUF is
# whole, prep, then STAGES bounded by the call's budget (SIGINT, then KILL), then always pack: the bundle parts,
# its set manifest, logs.tgz and table.txt come back in $OUT (<= 7 files). A warm machine keeps $W between calls
# (issue the next call within 30 s); a cold one gets everything back from what the next calls carry.
set -uo pipefail
STAGES=${1:?stages, e.g. "generate tokens"}
shift
REPO=${REPO:-$PWD}
KIT=${KIT:-$REPO/.device/scale/kit}
W=${W:-/root/scale}
BACK=${OUT:-$W/back}
BUDGET=${BUDGET:-570}    # seconds of this call (the device allows 600)
RESERVE=${RESERVE:-80}   # after SIGINT: finished shards to regen files (<= 40 s), pack (~10 s), the copy back
COMMON=${COMMON:-}       # options for every stage (the CPU dry run: "--tiny --device cpu --target-dir DIR")
T0=$(date +%s)
mkdir -p "$W/logs" "$BACK"
exec > >(tee -a "$W/logs/call-$T0.log") 2>&1
SITE=${SITE:-/tmp/site}
for whl in whl whl-peers; do  # the peers' wheels only when a call carries them
  if [ -d "$KIT/$whl" ] && [ ! -f "$SITE/.installed-$whl" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$KIT/$whl"/*.whl && touch "$SITE/.installed-$whl" || exit 4
  fi
done
export PYTHONPATH=$SITE:$REPO/scripts:$REPO/benchmarks PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
df -h "$W" | tail -1
# shellcheck disable=SC2086  # COMMON and STAGES are word lists
ras() { python3 "$REPO/benchmarks/recipe_at_scale.py" "$@" --work "$W" --kit "$KIT" $COMMON; }
ras gather --out "$W/out" --in "$(dirname "$KIT")"/in-* || exit 5  # the payload folders `carry` wrote
rc=0
if [ -f "$W/target/config.json" ] || ras target --out "$W/out"; then
  ras prep --out "$W/out" || rc=6
  left=$(( BUDGET - RESERVE - ($(date +%s) - T0) ))
  if [ "$rc" = 0 ] && [ "$left" -gt 30 ]; then
    timeout -s INT -k 40 "$left" python3 "$REPO/benchmarks/recipe_at_scale.py" $STAGES "$@" --work "$W" --kit "$KIT" \
      --out "$W/out" $COMMON
    rc=$?
  fi
else
  echo "target: the GGUF is not whole yet (its other part comes with the next call)"
fi
ras pack table --out "$BACK" || rc=7
tar czf "$BACK/logs.tgz" -C "$W" logs progress.json $(cd "$W" && ls -d results 2>/dev/null)
du -sh "$W"/* 2>/dev/null | sort -h | tail -5
echo "call: stages '$STAGES' exit $rc after $(( $(date +%s) - T0 )) s"
exit $rc
