#!/usr/bin/env bash
# The GPU measurements of issues 5 (attention kernels), 6 (GDN kernel) and 7 (reproduction study)
# as device calls of under 10 minutes each. One session's 30 minutes of device time hold about six
# such calls on one H100, which counts half its held time. Each stage writes a log and its
# JSON/figures under $OUT (at most 8 files, as the device tool returns them) and stops its steps
# at a deadline so that what ran still comes back.
#
# Run from the repository root on the device machine, with the wheels of
# ../shared/tools/gpu_wheels.sh carried as .whl (`carry=[".whl"]`):
#   bash tools/gpu_session.sh tests     # GPU parity tests (~9 min)
#   bash tools/gpu_session.sh kernels   # attention + decode benchmarks (~8 min; "attention": no decode)
#   bash tools/gpu_session.sh profile   # GDN pieces + FLA at one shape, attention pieces (~9 min)
#   bash tools/gpu_session.sh checks    # tiny-model checks (GDN, laLTE) and decode benchmark (~9 min)
#   bash tools/gpu_session.sh sweeps    # prefill and decode launch-parameter sweeps (~7 min)
#   bash tools/gpu_session.sh confirm   # decode + attention ratios at 3 lengths, no FLA (~6 min)
#   bash tools/gpu_session.sh kprofile  # per-kernel GPU time of decode and attention (~5 min)
#   bash tools/gpu_session.sh prep      # GDN preparation kernels vs XLA, 4 shapes; FLA at B4 H64
#   bash tools/gpu_session.sh gdn       # GDN vs FLA at shapes 0, 1 of issue 6 (~6-9 min)
#   bash tools/gpu_session.sh gdn23     # GDN vs FLA at shapes 3, 2 (~6-9 min)
#   bash tools/gpu_session.sh study     # the capacity study, resumable (tools/study_gpu.sh, ~9 min)
#   bash tools/gpu_session.sh multigpu  # kind nvidia-h200-x2: kernels per shard, FSDP scaling
# Then fold the numbers into docs/benchmarks.md / docs/results.md with the commands below.
set -uo pipefail
stage=${1:?usage: tools/gpu_session.sh tests|kernels|attention|profile|kprofile|checks|sweeps|confirm|prep|gdn|gdn23|study|multigpu}
out=${OUT:?OUT must name the directory that comes back}
budget_s=${BUDGET_S:-540}  # stop new steps after this many seconds (calls are cut at 600)
start=$(date +%s)

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# Compiled kernels (Triton's, FLA's autotuning results, XLA's programs) under the repository's
# ignored .cache/: shared by the steps and test workers of one call, and kept for the next call
# while the machine stays warm (it goes back 30 s after a call ends).
export TRITON_CACHE_DIR=$PWD/.cache/triton JAX_COMPILATION_CACHE_DIR=$PWD/.cache/jax \
  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
log="$out/$stage.log"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >"$log" 2>&1

# step SECONDS CMD...: runs CMD with at most SECONDS, and none of it past the stage's budget.
step() {
  local limit=$1; shift
  local left=$((budget_s - ($(date +%s) - start)))
  ((left < limit)) && limit=$left
  if ((limit < 20)); then echo "### skipped (budget): $*" >>"$log"; return; fi
  echo "### $(date +%T) (${limit}s) $*" >>"$log"
  timeout --signal=TERM --kill-after=15 "$limit" "$@" >>"$log" 2>&1
  echo "### exit $? after $(($(date +%s) - start))s" >>"$log"
}

case "$stage" in
  tests)
    # GPU parity tests; Triton compilation dominates, so they run 6 at once (session 5: one at a
    # time, 11 tests passed in 200 s).
    step 520 python3 -m pytest -q -m gpu tests/pallas_kernels tests/lalte_jax -n 6 \
      -p no:cacheprovider --durations=20
    ;;
  kernels|attention)
    # session 5 on an H100: the 4K run needed more than 150 s (its checks), the 8K/16K run ~100 s
    step 230 python3 tools/bench_attention.py --quick --iters 10 --json "$out/attention.json"
    step 150 python3 tools/bench_attention.py --no-checks --no-fla --iters 5 \
      --lengths 8192 16384 --only "SWA-1024" "LTE train" "LTE prefill (" "kept list" \
      --json "$out/attention_long.json"
    # "attention" leaves out the decode benchmark (for calls that add another stage)
    [ "$stage" = kernels ] && step 100 python3 tools/bench_decode_attention.py --repeats 20 \
      --json "$out/decode.json"
    ;;
  profile)
    # Where the time goes (session 6): the GDN preparation's parts at every shape of issue 6, FLA
    # at B1 T16384 K=128 only (its autotuning costs minutes per shape); the attention kernels next
    # to the prefill's XLA kept list at 3 lengths.
    step 300 python3 tools/compare_fla.py --quick --shapes 2,1,3,0 --fla-shapes 2 --no-train \
      --out "$out"
    step 230 python3 tools/bench_attention.py --no-checks --no-fla --iters 20 \
      --only "SWA-1024" "LTE train" "LTE prefill" "kept list" --json "$out/attention.json"
    ;;
  checks)
    # The model-level checks after a kernel change: gdn-tiny trained with the Pallas GDN kernel vs
    # the XLA reference (plus our GDN timings at one shape), the attention parity and laLTE-tiny
    # checks of bench_attention.py (only the cuDNN anchor timed), and the decode benchmark.
    step 200 python3 tools/compare_fla.py --quick --no-fla --shapes 1 --out "$out"
    step 260 python3 tools/bench_attention.py --quick --no-fla --iters 5 --only "cuDNN SWA-1024" \
      --json "$out/attention_checks.json"
    step 100 python3 tools/bench_decode_attention.py --repeats 20 --json "$out/decode.json"
    ;;
  sweeps)
    # Launch-parameter sweeps for the two attention targets still open on an H100: the LTE
    # prefill's forward blocks (B8 T4096) and decode at the lalte-1.4b cache (B32).
    step 220 python3 tools/bench_attention.py --sweep --no-checks --no-fla --iters 10 \
      --only prefill --json "$out/attention_sweep.json"
    step 180 python3 tools/bench_decode_attention.py --presets lalte-1.4b --sweep --repeats 10 \
      --json "$out/decode_sweep.json"
    ;;
  confirm)
    # The issue-5 ratios again after the benches' clock warm-up (session 6): decode at both caches,
    # then SWA, LTE training and LTE prefill at the three lengths (no FLA, no checks).
    step 90 python3 tools/bench_decode_attention.py --repeats 20 --json "$out/decode.json"
    step 240 python3 tools/bench_attention.py --no-checks --no-fla --iters 10 \
      --only "SWA-1024" "=ours LTE train (769 + 4 sinks + 256 kept)" "LTE prefill (" \
      --json "$out/attention.json"
    ;;
  kprofile)
    # Per-kernel GPU time (jax.profiler) of decode at both caches and of the attention targets at
    # 4K and 16K: which kernels of a call take the time, and how long the GPU idles between them.
    step 400 python3 tools/profile_kernels.py --json "$out/profile_kernels.json"
    ;;
  prep)
    # The per-chunk preparation kernels (the default; forward and forward + backward) next to the
    # XLA preparation at every shape (or SWEEP_SHAPES, e.g. "3,0"; launch configs of
    # pallas_prepare.PrepareConfig), then the GDN against FLA at B4 T4096 H64, the shape the
    # preparation limits most (session 6).
    step 280 python3 tools/compare_fla.py --quick --sweep-prep --no-fla --no-train --shapes 3 \
      --sweep-shapes "${SWEEP_SHAPES:-3,0,1,2}" --out "$out/sweep"
    step 250 python3 tools/compare_fla.py --quick --no-train --shapes 3 --out "$out/shape3"
    ;;
  gdn|gdn23)
    # One shape per step: FLA autotunes on its first call per shape. Measured on a fresh H100
    # (session 8): B8 T4096 K=V=256 (shape 0) and B4 T4096 H64 (3) need ~240-300 s each with FLA,
    # B8 T4096 K=V=128 (1) and B1 T16384 (2) ~100 s; a 265 s step cut shape 0 before FLA ran.
    # Each run writes <dir>/compare_fla.json after every result.
    shapes=(0 1); [ "$stage" = gdn23 ] && shapes=(3 2)
    [ -n "${GDN_SHAPES:-}" ] && read -ra shapes <<<"$GDN_SHAPES"  # e.g. GDN_SHAPES="2"
    for shape in "${shapes[@]}"; do
      mkdir -p "$out/shape$shape"
      limit=200; [[ "$shape" == 0 || "$shape" == 3 ]] && limit=330
      step "$limit" python3 tools/compare_fla.py --quick --shapes "$shape" --no-train \
        --out "$out/shape$shape"
    done
    ;;
  study)
    # The capacity study, continued from the state that the previous call packed (see
    # tools/study_gpu.sh; it has its own budget and pip install).
    bash tools/study_gpu.sh "$out"  # appends to the same $out/study.log
    ;;
  multigpu)
    # Pallas kernels inside shard_map on real GPUs (lalte_jax/sharding.py), then the 0.4b step on
    # one GPU and with the batch and parameters split over all of them (same per-GPU batch).
    step 200 python3 -m pytest -q -m gpu tests/lalte_jax/test_sharding.py -p no:cacheprovider
    # cuDNN's SWA attention alone under shard_map (session 9: the gdn_swa FSDP step crashed).
    step 200 python3 tools/repro_cudnn_multigpu.py
    step 150 env CUDA_VISIBLE_DEVICES=0 python3 tools/bench_train.py --presets lalte-0.4b \
      gdn_swa-0.4b --batch 4 --steps 3 \
      --warmup 1 --json "$out/train_1gpu.json"
    n=$(nvidia-smi -L | wc -l)
    step 200 python3 tools/bench_train.py --presets lalte-0.4b gdn_swa-0.4b --batch 4 \
      --mesh_fsdp "$n" --steps 3 --warmup 1 --json "$out/train_fsdp.json"  # --batch is per GPU
    ;;
  *)
    echo "unknown stage: $stage (tests, kernels, attention, profile, checks, sweeps, confirm, prep, gdn, gdn23, study or multigpu)" >&2; exit 2 ;;
esac
echo "### stage $stage done in $(($(date +%s) - start))s" >>"$log"
tail -n 60 "$log"
