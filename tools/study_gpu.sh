#!/usr/bin/env bash
# The capacity study (tools/repro.py) on one GPU machine, in invocations of under 9 minutes that
# each continue where the previous one stopped.
#
#   bash tools/study_gpu.sh RESULT_DIR [STATE_PREFIX]
#
# Run from the repository root with the wheels of the extra dependencies (grain, array-record,
# portpicker, tensorboardX) in .whl/. The study lives in STUDY_DIR (default runs/capacity; another
# directory holds a variant, e.g. shorter runs with STUDY_ARGS="--steps 16000"). When it does
# not exist yet (a fresh machine) and the parts STATE_PREFIX.NNofMM exist (default
# .gpu/study/state.tar.gz: what the previous invocation packed), they are unpacked first; the
# published finished runs are restored next (STUDY_RESTORE, below). Then
# tools/repro.py trains within the budget, and RESULT_DIR receives:
#   study.log            this script's log (tools/repro.py's output and the runs' ends);
#   results.md           the tables and checks so far;
#   report.tar.gz        results.json/.md, trajectories.json, the figures, every run's small files;
#   state.tar.gz.00ofMM  the state for the next invocation (tools/repro_state.py; at most
#   ...                  STUDY_MAX_PARTS parts of 14 MiB): put them where STATE_PREFIX points.
# STUDY_BUDGET_S (default 510) bounds the whole script, STUDY_PARALLEL (default 12 per GPU) the
# runs at once; STUDY_ARGS adds arguments to tools/repro.py (e.g. "--models gdn_attn,lalte").
set -uo pipefail
mkdir -p "${1:?usage: tools/study_gpu.sh RESULT_DIR [STATE_PREFIX]}"
result=$(cd "$1" && pwd)  # absolute: the report is packed from inside the study directory
state=${2:-.gpu/study/state.tar.gz}
budget_s=${STUDY_BUDGET_S:-510}
start=$(date +%s)
study=${STUDY_DIR:-runs/capacity}
log="$result/study.log"

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >>"$log" 2>&1 || { echo "pip install failed" >>"$log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# Compiled programs under the ignored .cache/: shared by the runs of one invocation and kept for
# the next one while the machine stays up.
export TRITON_CACHE_DIR=$PWD/.cache/triton JAX_COMPILATION_CACHE_DIR=$PWD/.cache/jax \
  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
nvidia-smi --query-gpu=name,memory.total --format=csv >>"$log" 2>&1
# On a machine of several GPUs each run starts on the least busy one (tools/repro.py --devices).
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
devices=()
[ "$gpus" -gt 1 ] && devices=(--devices "$(seq -s, 0 $((gpus - 1)))")

if [ ! -d "$study/runs" ] && compgen -G "$state.[0-9][0-9]of[0-9][0-9]" >/dev/null; then
  python3 tools/repro_state.py unpack "$state" "$study" >>"$log" 2>&1
fi
# The published finished runs (STUDY_RESTORE, default docs/data/capacity_48k for the default
# study directory; empty: none), so that the report counts them with the new ones; a run already
# in the study is kept (tools/repro_state.py restore skips it, or stops at a conflicting one).
restore=${STUDY_RESTORE-$([ "$study" = runs/capacity ] && echo docs/data/capacity_48k)}
if [ -n "$restore" ]; then
  python3 tools/repro_state.py restore "$restore" "$study" >>"$log" 2>&1 \
    || { echo "restore of $restore failed (see above)" >>"$log"; exit 1; }
fi
# Leave ~60 s for the figures and the packing after tools/repro.py returns.
left=$((budget_s - ($(date +%s) - start) - 60))
echo "### $(date +%T) tools/repro.py with ${left}s" >>"$log"
# shellcheck disable=SC2086  # STUDY_ARGS is a list of arguments
python3 tools/repro.py --out "$study" --parallel "${STUDY_PARALLEL:-$((12 * (gpus > 1 ? gpus : 1)))}" \
  --budget-s "$left" "${devices[@]}" ${STUDY_ARGS:-} >>"$log" 2>&1
echo "### exit $? after $(($(date +%s) - start))s" >>"$log"
for run in "$study"/runs/*/; do  # the end of each run's log, for the record
  echo "### $run" >>"$log"; tail -n 3 "$run/log.txt" >>"$log" 2>&1
done

timeout 40 python3 tools/plot_results.py --results "$study" --out "$study/figures" >>"$log" 2>&1
cp "$study/results.md" "$result/results.md" 2>>"$log"
(cd "$study" && tar -czf "$result/report.tar.gz" results.json results.md trajectories.json figures \
  runs/*/records.json runs/*/metrics.jsonl runs/*/run.json) 2>>"$log"
python3 tools/repro_state.py pack "$study" "$result/state.tar.gz" --part-mib 14 \
  --max-parts "${STUDY_MAX_PARTS:-5}" >>"$log" 2>&1
echo "### done after $(($(date +%s) - start))s" >>"$log"
tail -n 40 "$log"
