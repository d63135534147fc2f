#!/usr/bin/env bash
# One device call of benchmarks/recipe_at_scale.py (issue 25), run from the root of the checkout that travels:
#
#   bash benchmarks/recipe_at_scale_device.sh "STAGES" [recipe_at_scale.py options]
#   e.g.  "generate"  |  "train evaluate" --runs paper  |  "train evaluate" --runs no-weighting@sub,layers-3@sub
#
# What to carry: `recipe_at_scale.py carry [--cold] [--in FILES_AT_OF_THE_LAST_CALL]` (here) writes the payload
# folders .device/scale/in-K (GGUF parts, the last bundle's parts) and prints each call's carry list: call 1 also
# carries .device/scale/kit/data and .device/scale/kit/whl (+ kit/whl-peers for the peers' stages). Every call:
# install the wheels once, gather the payload (parts aside into $W/in, complete sets joined, a bundle newer than
# this machine's state unpacked, the kit's data put aside), prep, import the target once the GGUF is whole, then
# STAGES bounded by the call's budget (SIGINT, then KILL), then always pack: the bundle parts, its set manifest
# and logs.tgz (logs, results, table.txt) come back in $OUT (<= 8 files). A warm machine keeps $W between calls
# (issue the next call within 30 s); a cold one gets everything back from what the next calls carry.
#
# The peers on the largest subset that fits the disk + /dev/shm (one peer at a time; its files and its trainer's
# checkpoints stay only on the warm machine, so a peer's calls follow each other without a pause):
#   "tokens peer-plan peer-data peer-train" --peer specforge --peer-all --specforge-batch 4
#   "peer-train evaluate peer-clean" --peer specforge --specforge-batch 4     # again until it is trained
#   "peer-data peer-train" --peer speculators, then "peer-train evaluate peer-clean" --peer speculators
set -uo pipefail
STAGES=${1:?stages, e.g. "generate tokens"}
shift
REPO=${REPO:-$PWD}
KIT=${KIT:-$REPO/.device/scale/kit}
# the run's state committed with the repository (it travels with every call): a cold machine starts from it instead
# of regenerating; STATE= (empty) leaves it out
STATE=${STATE-$REPO/benchmarks/recipe_at_scale_state}
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
if [ ! -f "$SITE/.installed-whl" ]; then
  echo "a cold machine without the kit's wheels: start again from call 1 (recipe_at_scale.py carry --cold)"; exit 3
fi
export PYTHONPATH=$SITE:$REPO/scripts:$REPO/benchmarks PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
df -h "$W" /dev/shm | tail -n +2  # the disk for the peers' files, and memory-backed room beside it
grep -E '^(MemTotal|MemAvailable|Shmem):' /proc/meminfo | tr -s ' ' | paste -sd ' '  # what bounds the shm share
# shellcheck disable=SC2086  # COMMON and STAGES are word lists
ras() { python3 "$REPO/benchmarks/recipe_at_scale.py" "$@" --work "$W" --kit "$KIT" $COMMON; }
# the payload folders `carry` wrote; the committed state, unpacked where this machine has none as new
ras gather --out "$W/out" --in "$(dirname "$KIT")"/in-* ${STATE:+--state "$STATE"} || exit 5
rc=0
ras prep --out "$W/out" || rc=6  # needs the kit's data only (carried, or put aside by gather)
if [ "$rc" = 0 ] && { [ -f "$W/target/config.json" ] || ras target --out "$W/out"; }; then
  left=$(( BUDGET - RESERVE - ($(date +%s) - T0) ))
  if [ "$left" -gt 30 ]; then
    timeout -s INT -k 40 "$left" python3 "$REPO/benchmarks/recipe_at_scale.py" $STAGES "$@" --work "$W" --kit "$KIT" \
      --out "$W/out" $COMMON
    rc=$?
  fi
else
  echo "target: the GGUF is not whole yet (its other part comes with the next call)"
fi
ras pack --out "$BACK" || rc=7
ras table --out "$W/logs" || true
tar czf "$BACK/logs.tgz" -C "$W" logs progress.json $(cd "$W" && ls -d results 2>/dev/null)
du -sh "$W"/* 2>/dev/null | sort -h | tail -5
echo "call: stages '$STAGES' exit $rc after $(( $(date +%s) - T0 )) s"
exit $rc
