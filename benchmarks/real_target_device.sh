#!/usr/bin/env bash
# The GPU side of benchmarks/real_target_side_by_side.py, one device call each, run from the root of the checkout
# that travels, with the kit (stage `kit` writes it here: wheels, data, GGUF halves) carried under .device/realbench:
#
#   call 1, carry whl + gguf.partA:  bash benchmarks/real_target_device.sh 1 [benchmark commands ...]
#   call 2, carry data + gguf.partB: bash benchmarks/real_target_device.sh 2    (then 3, 4: the same chain resumed)
#   PEERS=0 bash benchmarks/real_target_device.sh 2: ours, the untrained drafter and the variants only
#   UNTIL=hidden/groups/X ...: the workflow up to that results path (default all)
#
# Call 1 installs the wheels, copies its GGUF half aside and runs the benchmark commands given to it (each
# stopped before the call's budget). Later calls join the halves and run the chain: the workflow on the real
# Snakefile (everything, import to evaluation), the evaluation of ours and the untrained drafter, our trainer's
# variants (VARIANT_RUNS) and their evaluation, the peers' data, speculators and its evaluation, the loaders'
# check, the table, then SpecForge (the slowest: batch 1) and its evaluation. Every stage skips what it finished, so a call that runs out of time leaves the rest to the next.
# State lives in $W (outside the working tree) and survives while the machine stays warm (30 s after a call):
# issue the next call at once; a cold machine starts again from call 1.
set -uo pipefail
CALL=${1:?call 1, 2, 3 ...}
shift
KIT=${KIT:-$PWD/.device/realbench}
REPO=${REPO:-$PWD}
W=${W:-/root/rb}
BACK=${OUT:-$W/back}
OUT=$W/out
BUDGET=${BUDGET:-560}
T0=$(date +%s)
mkdir -p "$W" "$OUT" "$BACK"
exec > >(tee -a "$OUT/device_call_$CALL.log") 2>&1
if [ ! -f /tmp/site/.installed ]; then
  if ! ls "$KIT"/whl/*.whl > /dev/null 2>&1; then
    echo "cold machine and no wheels carried: start again from call 1"; exit 3
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$KIT"/whl/*.whl \
    && touch /tmp/site/.installed || exit 4
fi
export PYTHONPATH=/tmp/site:$REPO/scripts:$REPO/benchmarks PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
sbs() {  # one stage, stopped (SIGINT, then KILL) before the call's budget runs out
  local t; t=$(left)
  if [ "$t" -lt 30 ]; then echo "no time left for: $*"; return 1; fi
  timeout -s INT -k 15 "$t" python3 "$REPO/benchmarks/real_target_side_by_side.py" "$@" --work "$W" --out "$OUT" --kit "$KIT"
}
# copies the carried GGUF half aside (with both halves: join, sha256, import): not bounded by the call's budget,
# which the wheels' install may have taken (a short call 1 then left its half behind)
timeout -s INT -k 15 300 python3 "$REPO/benchmarks/real_target_side_by_side.py" target --work "$W" --out "$OUT" --kit "$KIT"
rc=0
if [ "$CALL" = 1 ]; then
  python3 -c "import snakemake, specforge, speculators, dflash, gguf, zstandard, datasets; print('imports ok')" || rc=5
  for cmd in "$@"; do  # each benchmark bounded by what is left of the call
    t=$(left); [ "$t" -lt 30 ] && { echo "no time left for: $cmd"; break; }
    echo "== $cmd"; timeout -s INT -k 15 "$t" bash -c "$cmd" || echo "exit $? from: $cmd"
  done
else
  # ours (and the untrained drafter) evaluated first: a call that runs out of time still has our tau
  sbs workflow --until "${UNTIL:-all}"; sbs evaluate; sbs table  # evaluate needs the export only (a failed gate still tells tau)
  sbs variants && sbs evaluate; sbs table  # our trainer with fewer samples per step (VARIANT_RUNS)
  if [ "${PEERS:-1}" = 1 ]; then  # PEERS=0: ours only (the peers' figures of an earlier run stand)
    sbs peer-data && sbs speculators && sbs evaluate; sbs compat; sbs table
    sbs specforge && sbs evaluate; sbs table
  fi
  rc=$?
fi
du -sh "$W"/* 2>/dev/null | sort -h | tail -6
echo "call $CALL: exit $rc after $(( $(date +%s) - T0 )) s"
tar czf "$BACK/rb_call$CALL.tgz" -C "$W" out
cp "$OUT/table.txt" "$BACK/" 2>/dev/null
exit $rc
