#!/usr/bin/env bash
# The GPU commands of benchmarks/real_target_side_by_side.py (issue 17), one per device call, run from the root of
# the checkout that travels, with the kit (stage `kit`: data, GGUF halves, wheels, a copy of this repo) carried:
#
#   bash .device/realbench/repo/benchmarks/real_target_device.sh 1   # wheels, GGUF half A; extract compile bench
#   bash .device/realbench/repo/benchmarks/real_target_device.sh 2   # half B, target, hf rates, workflow, peer data
#   bash .device/realbench/repo/benchmarks/real_target_device.sh 3   # peers' training, evaluation, compat, table
#   (3 again, or 4: what the last call left; the workflow's own evaluate and gate last)
#
# State lives in $W (outside the working tree) and survives while the machine stays warm (30 s after a call):
# issue the next call at once. Every stage skips what it finished; a cold machine redoes the chain from call 1.
# Each call stops its stages before $BUDGET seconds so that its logs and JSON come back: everything the stages
# wrote so far ($W/out) as one archive in the device's $OUT (which takes back at most 8 files), plus the table.
set -uo pipefail
CALL=${1:?call 1, 2 or 3}
KIT=${KIT:-$PWD/.device/realbench}
REPO=$KIT/repo
W=${W:-/root/rb}
BACK=${OUT:-$W/back}
OUT=$W/out
BUDGET=${BUDGET:-570}
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
export PYTHONPATH=/tmp/site:$REPO/scripts PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
sbs() {  # one stage, stopped (SIGINT, then KILL) before the call's budget runs out
  local t; t=$(left)
  if [ "$t" -lt 20 ]; then echo "no time left for: $*"; return 1; fi
  timeout -s INT -k 15 "$t" python3 "$REPO/benchmarks/real_target_side_by_side.py" "$@" --work "$W" --out "$OUT" --kit "$KIT"
}
sbs target  # copies the carried GGUF half aside; with both halves: join, sha256, convert
case "$CALL" in
  1) python3 -c "import snakemake, specforge, speculators, dflash, gguf, zstandard, datasets; print('imports ok')"
     timeout -s INT "$(left)" python3 "$REPO/benchmarks/extract_compile_auto.py" --shape smollm2-135m \
       --samples 640,6000 --json "$OUT/extract_compile_auto.json" ;;
  2) sbs workflow --until target/config.json && sbs gen-bench && sbs workflow --until drafter && sbs peer-data ;;
  3) sbs workflow --until drafter && sbs peer-data; sbs specforge; sbs speculators; sbs evaluate; sbs compat; sbs table
     sbs workflow --until all ;;
  4) sbs workflow --until drafter && sbs peer-data; sbs specforge; sbs speculators; sbs evaluate; sbs compat; sbs table
     sbs workflow --until all ;;
esac
rc=$?
du -sh "$W"/* 2>/dev/null | sort -h | tail -6
echo "call $CALL: exit $rc after $(( $(date +%s) - T0 )) s"
tar czf "$BACK/rb_call$CALL.tgz" -C "$W" out
cp "$OUT/table.txt" "$BACK/" 2>/dev/null
exit $rc
