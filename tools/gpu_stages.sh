#!/usr/bin/env bash
# The GPU measurements as named stages: GPU tests, kernel benchmarks and profiles, the
# reproduction study. docs/benchmarks.md and docs/results.md hold what they measured.
#
#   bash tools/gpu_stages.sh STAGE [--out DIR] [--budget SECONDS] [--wheels DIR]
#
# --out DIR (or OUT_DIR): where the stage writes its log (STAGE.log) and its JSON, figures and
#     archives; default runs/gpu/STAGE.
# --budget SECONDS (or STAGE_BUDGET_S): time budget of the whole stage. No step starts after it,
#     and a running step is stopped at it, so the stage fits a fixed time slot and keeps what ran.
#     Default 0: no budget (every step still has its own time limit below).
# --wheels DIR (or WHEELS_DIR): first install the wheel files in DIR (no index, no dependencies)
#     into a private site directory, for a GPU machine without network access. Without it the
#     current environment must have the package's `cuda` and `dev` extras.
#
# Stages (approximate duration on one H100):
#   tests      GPU parity tests (~9 min)
#   kernels    attention + decode benchmarks (~8 min); "attention": the same without decode
#   profile    GDN pieces + FLA at one shape, attention pieces (~9 min)
#   checks     tiny-model checks (GDN, laLTE) and the decode benchmark (~9 min)
#   sweeps     prefill and decode launch-parameter sweeps (~7 min)
#   confirm    decode + attention ratios at 3 lengths, no FLA (~6 min)
#   kprofile   per-kernel GPU time of decode and attention (~5 min)
#   prep       GDN preparation kernels against XLA at 4 shapes; FLA at B4 H64
#   gdn        GDN against FLA at shapes 0 and 1 of tools/compare_fla.py (~6-9 min)
#   gdn23      GDN against FLA at shapes 3 and 2 (~6-9 min)
#   study      the capacity study, resumable across runs (tools/study_gpu.sh, ~9 min)
#   trainlte   laLTE's training cost against GDN+SWA: the router's pieces (tools/bench_router.py),
#              the 0.4b pair with its GPU time by op class, the 1.4b pair over per-device batches
#              1, 2, 4 (the fastest marked) (~7 min)
#   trainprofile the 0.4b presets' steps at 8 sequences by op class, kernel GB/s and the model's
#              named scopes (bench_train --profile; ~7 min)
#   remat      the 0.4b presets' training step under the remat policies dots_attention, none and
#              dots (4 sequences per GPU, routers at 12.5% kept; ~6 min)
#   decodeflags the 1.4b decode step and `generate` with the serving flags, without them and with
#              XLA's programmatic dependent launch on top (~8 min)
#   layercopies the 0.4b pair's step scanned, with XLA's dynamic-slice fusion (with and without
#              command buffers) and unrolled: the copies into and out of the scan's per-layer
#              buffers (~6 min a round; --budget 560 keeps the first)
#   batches    the training step at the per-device batches bench_train picks from (the fastest
#              that fits marked), routers at 12.5% kept: gdn_swa-0.4b and lalte-0.4b at 8, 12
#              and 16 (each batch a process compiling its unrolled step: ~65 s a row; ~7 min)
#   batches14  the same for gdn_swa-1.4b and lalte-1.4b at 4 and 8 (~7 min)
#   ltesweep   LTE training attention's backward blocks at a lalte-0.4b layer (16 query heads over
#              16 KV heads, window 769, 512 kept per KV head: routers at 12.5%), B8 T4096, with
#              the kept-list dk/dv split into query chunks among the candidates (~4 min)
#   shortconv  GDN's short convolution: its GPU parity tests and the kernels against XLA by GPU
#              kernel time, with the launch candidates (tools/bench_short_conv.py --sweep; ~2 min)
#   ab         this tree's training step against another's, two rounds in the order base, this,
#              this, base (tools/bench_train_ab.py; AB_BASE: a directory holding that tree's
#              lalte_jax, pallas_kernels and tools, e.g. from `git archive`; relative paths from
#              the repository root): gdn_swa-0.4b and lalte-0.4b at 8 sequences, routers at
#              12.5% (~8 min)
#   servingab  this tree's `generate` against another's (AB_BASE, as for `ab`), two rounds in the
#              order base, this, this, base: lalte-1.4b at 32 rows after a 4K prompt
#              (SERVINGAB_ARGS: other bench_serving arguments; one run ~2 min), then each run's
#              ms a token (~8 min)
#   tma        SWA-1024 as native Triton kernels with TMA descriptors (tools/probe_tma_attention.py)
#              against our Pallas kernels and cuDNN, forward and forward+backward (~4 min)
#   longprompt prefill of one 64K prompt, whole and in chunks of 8192 tokens: memory and tokens/s
#              of gdn-1.4b, gdn_swa-1.4b and lalte-1.4b (tools/bench_serving.py; ~5 min)
#   anchors    our training step next to FLA's PyTorch models of the same configs (0.4b; ours at
#              8 and 12 sequences, FLA eager at 8 and 16, then torch.compile at 8 within the
#              budget; ~9 min without compile: FLA autotunes its kernels for ~4 min first)
#   serving    prefill and decode of the 1.4b presets against the decode step's bytes bound
#              (tools/bench_serving.py; SERVING_ARGS selects; ~5 min)
#   routerprofile the LTE router's fwd+bwd at lalte-0.4b, 8 sequences: its variants, then its GPU
#              time by kernel as the training step runs it (bench_router --profile; ~3 min)
#   decodegemm the decode step's GEMMs under XLA's GEMM backends (Triton fusions, cuBLAS, cuBLASLt):
#              `generate` of lalte-1.4b B32 after 4K with each (DECODEGEMM_ARGS to change; ~6 min)
#   genloop    generate's loop against pipelined decode steps: the GPU test that the loop copies no
#              cache and no weight, and the loop's GPU time per token by op class (~4 min)
#   flaprefill the prefill table (1.4b at 4K) with FLA's rows (~6 min, FLA autotunes)
#   decode     the whole-model decode step (lalte-1.4b, gdn_swa-1.4b; B32 and B1 after 4K), ours
#              and with XLA's default CUDA-graph size, then the GDN recurrent step's launch
#              parameters against the copy (tools/bench_gdn_decode.py --sweep) (~6 min)
#   nsadecode  NSA decoding: the decode kernels' GPU parity tests, the decode attention's timings
#              at 4K-64K (tools/bench_nsa.py) and the lansa-1.4b decode step at 4K and 64K (~5 min)
#   nsatrain   NSA training: the NSA GPU parity tests, our kernels per launch-parameter candidate
#              at T 4K (tools/bench_nsa.py --sweep, with each candidate's kernel times) and the
#              lansa-0.4b / gdn_swa-0.4b training step (~6 min)
#   multigpu   several GPUs of one host: scaling of the training step over 1, 2, 4 GPUs as N
#              processes and as one process, a resume on fewer processes, then the kernels per
#              shard (~9 min)
#   determinism  several GPUs, with the trainer's reproducible=true: whether N processes compute
#              the one-process step bit for bit (lalte-0.4b and 1.4b on 4 GPUs), and a bf16
#              lalte-1.4b FSDP checkpoint of 4 processes resumed by 4, 2 and 1 processes on the
#              same GPUs (~8 min)
# The training steps run unrolled (bench_train's default since 2026-11-29), which compiles 3-4x
# longer than the scan: a cold 0.4b step 25-60 s, a 1.4b step 25-45 s on an H200.
# Run from anywhere; the stage runs in the repository root.
set -uo pipefail
stages="tests|kernels|attention|profile|kprofile|checks|sweeps|confirm|prep|gdn|gdn23|study|trainlte|trainprofile|remat|batches|batches14|layercopies|ltesweep|shortconv|ab|servingab|tma|longprompt|anchors|serving|decodeflags|decodegemm|routerprofile|genloop|flaprefill|decode|nsadecode|nsatrain|multigpu|determinism"
usage="usage: tools/gpu_stages.sh $stages [--out DIR] [--budget SECONDS] [--wheels DIR]"
(($#)) || { echo "$usage" >&2; exit 2; }
stage=$1
shift
dest=${OUT_DIR:-runs/gpu/$stage}
budget_s=${STAGE_BUDGET_S:-0}
wheels=${WHEELS_DIR:-}
while (($#)); do
  case "$1" in
    --out) dest=${2:?$usage}; shift 2 ;;
    --budget) budget_s=${2:?$usage}; shift 2 ;;
    --wheels) wheels=${2:?$usage}; shift 2 ;;
    *) echo "unknown argument: $1" >&2; echo "$usage" >&2; exit 2 ;;
  esac
done
[[ "|$stages|" == *"|$stage|"* ]] || { echo "unknown stage: $stage" >&2; echo "$usage" >&2; exit 2; }
[[ "$budget_s" =~ ^[0-9]+$ ]] || { echo "--budget must be whole seconds, got $budget_s" >&2; exit 2; }
mkdir -p "$dest" && dest=$(cd "$dest" && pwd) || exit 2
[ -n "$wheels" ] && { wheels=$(cd "$wheels" && pwd) || exit 2; }
cd "$(dirname "$0")/.." || exit 2
start=$(date +%s)

export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 \
  XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -n "$wheels" ]; then
  site=${TMPDIR:-/tmp}/lalte-gpu-site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"/*.whl || exit 1
  export PYTHONPATH=$site:$PYTHONPATH
fi
# Compiled kernels (Triton's, FLA's autotuning results, XLA's programs) under the repository's
# ignored .cache/: shared by the steps and test workers of a stage, and by the next stage.
export TRITON_CACHE_DIR=$PWD/.cache/triton JAX_COMPILATION_CACHE_DIR=$PWD/.cache/jax \
  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
log="$dest/$stage.log"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >"$log" 2>&1

# step SECONDS CMD...: runs CMD for at most SECONDS, and none of it past the stage's budget.
step() {
  local limit=$1; shift
  if ((budget_s > 0)); then
    local left=$((budget_s - ($(date +%s) - start)))
    ((left < limit)) && limit=$left
    if ((limit < 20)); then echo "### skipped (budget): $*" >>"$log"; return; fi
  fi
  echo "### $(date +%T) (${limit}s) $*" >>"$log"
  timeout --signal=TERM --kill-after=15 "$limit" "$@" >>"$log" 2>&1
  local status=$?
  echo "### exit $status after $(($(date +%s) - start))s" >>"$log"
  return $status
}

case "$stage" in
  tests)
    # Triton compilation dominates, so the tests run 6 at once (one at a time, 11 tests took
    # 200 s on an H100, 2026-11-22).
    step 520 python3 -m pytest -q -m gpu tests/pallas_kernels tests/lalte_jax -n 6 \
      -p no:cacheprovider --durations=20
    ;;
  kernels|attention)
    # On an H100 (2026-11-22) the 4K run needs more than 150 s (its checks), the 8K/16K run ~100 s.
    step 230 python3 tools/bench_attention.py --quick --iters 10 --json "$dest/attention.json"
    step 150 python3 tools/bench_attention.py --no-checks --no-fla --iters 5 \
      --lengths 8192 16384 --only "SWA-1024" "LTE train" "LTE prefill (" "kept list" \
      --json "$dest/attention_long.json"
    [ "$stage" = kernels ] && step 100 python3 tools/bench_decode_attention.py --repeats 20 \
      --json "$dest/decode.json"
    ;;
  profile)
    # Where the time goes: the GDN preparation's parts at every shape, FLA at B1 T16384 K=128 only
    # (its autotuning costs minutes per shape); the attention kernels next to the prefill's XLA
    # kept list at 3 lengths.
    step 300 python3 tools/compare_fla.py --quick --shapes 2,1,3,0 --fla-shapes 2 --no-train \
      --out "$dest"
    step 230 python3 tools/bench_attention.py --no-checks --no-fla --iters 20 \
      --only "SWA-1024" "LTE train" "LTE prefill" "kept list" --json "$dest/attention.json"
    ;;
  checks)
    # The model-level checks after a kernel change: gdn-tiny trained with the Pallas GDN kernel vs
    # the XLA reference (plus our GDN timings at one shape), the attention parity and laLTE-tiny
    # checks of bench_attention.py (only the cuDNN anchor timed), and the decode benchmark.
    step 200 python3 tools/compare_fla.py --quick --no-fla --shapes 1 --out "$dest"
    step 260 python3 tools/bench_attention.py --quick --no-fla --iters 5 --only "cuDNN SWA-1024" \
      --json "$dest/attention_checks.json"
    step 100 python3 tools/bench_decode_attention.py --repeats 20 --json "$dest/decode.json"
    ;;
  sweeps)
    # Launch-parameter sweeps: the LTE prefill's forward blocks (B8 T4096) and decode at the
    # lalte-1.4b cache (B32).
    step 220 python3 tools/bench_attention.py --sweep --no-checks --no-fla --iters 10 \
      --only prefill --json "$dest/attention_sweep.json"
    step 180 python3 tools/bench_decode_attention.py --presets lalte-1.4b --sweep --repeats 10 \
      --json "$dest/decode_sweep.json"
    ;;
  confirm)
    # The headline ratios: decode at both caches, then SWA, LTE training and LTE prefill at the
    # three lengths (no FLA, no checks).
    step 90 python3 tools/bench_decode_attention.py --repeats 20 --json "$dest/decode.json"
    step 240 python3 tools/bench_attention.py --no-checks --no-fla --iters 10 \
      --only "SWA-1024" "=ours LTE train (769 + 4 sinks + 256 kept)" "LTE prefill (" \
      --json "$dest/attention.json"
    ;;
  kprofile)
    # Per-kernel GPU time (jax.profiler) of decode at both caches and of the attention targets at
    # 4K and 16K: which kernels of a call take the time, and how long the GPU idles between them.
    step 400 python3 tools/profile_kernels.py --json "$dest/profile_kernels.json"
    ;;
  prep)
    # The per-chunk preparation kernels (the default; forward and forward + backward) next to the
    # XLA preparation at every shape (or SWEEP_SHAPES, e.g. "3,0"; launch configs of
    # pallas_prepare.PrepareConfig), then the GDN against FLA at B4 T4096 H64, the shape the
    # preparation limits most.
    step 280 python3 tools/compare_fla.py --quick --sweep-prep --no-fla --no-train --shapes 3 \
      --sweep-shapes "${SWEEP_SHAPES:-3,0,1,2}" --out "$dest/sweep"
    step 250 python3 tools/compare_fla.py --quick --no-train --shapes 3 --out "$dest/shape3"
    ;;
  gdn|gdn23)
    # One shape per step: FLA autotunes on its first call per shape. On a fresh H100 (2026-11-23)
    # B8 T4096 K=V=256 (shape 0) and B4 T4096 H64 (3) need ~240-300 s each with FLA,
    # B8 T4096 K=V=128 (1) and B1 T16384 (2) ~100 s; a 265 s limit cut shape 0 before FLA ran.
    # Each run writes <dir>/compare_fla.json after every result. GDN_SHAPES="2" picks shapes.
    shapes=(0 1); [ "$stage" = gdn23 ] && shapes=(3 2)
    [ -n "${GDN_SHAPES:-}" ] && read -ra shapes <<<"$GDN_SHAPES"
    for shape in "${shapes[@]}"; do
      mkdir -p "$dest/shape$shape"
      limit=200; [[ "$shape" == 0 || "$shape" == 3 ]] && limit=330
      step "$limit" python3 tools/compare_fla.py --quick --shapes "$shape" --no-train \
        --out "$dest/shape$shape"
    done
    ;;
  study)
    # The capacity study, continued from the state a previous run packed (tools/study_gpu.sh has
    # its own time budget, STUDY_BUDGET_S, and its own wheel install).
    bash tools/study_gpu.sh "$dest"
    ;;
  trainlte)
    # What laLTE's training step costs beyond GDN+SWA's (docs/benchmarks.md section 5): the
    # router alone, then both 0.4b presets with the routers at the paper's 12.5% kept and their
    # GPU time by op class, then both 1.4b presets at per-device batches 1, 2, 4.
    step 90 python3 tools/bench_router.py --presets lalte-0.4b lalte-1.4b \
      --json "$dest/router.json"
    step 200 python3 tools/bench_train.py --presets gdn_swa-0.4b lalte-0.4b --batch 4 --steps 5 \
      --warmup 2 --lte_kept_fraction 0.125 --profile --profile_steps 2 \
      --json "$dest/train_0_4b.json"
    step 360 python3 tools/bench_train.py --presets gdn_swa-1.4b lalte-1.4b --batch 1 2 4 \
      --steps 3 --warmup 1 --lte_kept_fraction 0.125 --json "$dest/train_1_4b.json"
    ;;
  trainprofile)
    # Where each 0.4b preset's step spends its GPU time at 8 sequences: op classes, the kernels'
    # GB/s against the copy bandwidth and the time per named scope of the model (rms_norm,
    # swiglu, <kind>_mixer, gdn_gates, gdn_output, lte_router, lm_head; tools/step_profile.py).
    step 560 python3 tools/bench_train.py --presets gdn_swa-0.4b lalte-0.4b gdn-0.4b lansa-0.4b \
      --batch 8 --steps 4 --warmup 2 --lte_kept_fraction 0.125 --profile --profile_steps 2 \
      --json "$dest/train_profile.json"
    ;;
  remat)
    # Each policy's run holds the three presets, each in its own process (bench_train's default).
    # `none` keeps every activation (bench_train's default): scanned it lost 13-14% to the
    # stacked buffers' copies; unrolled it is 6-11% faster than dots_attention (2026-11-29).
    for policy in dots_attention none dots; do
      step 240 python3 tools/bench_train.py --presets gdn_swa-0.4b lalte-0.4b lansa-0.4b \
        --batch 4 --steps 5 --warmup 2 --lte_kept_fraction 0.125 --remat "$policy" \
        --json "$dest/train_$policy.json"
    done
    ;;
  batches)
    # MFU and laLTE's ratio are quoted at each preset's fastest batch that fits; each batch is a
    # child process, and a preset stops at its first batch that runs out of memory. Six rows of
    # ~65 s each (compiling the unrolled step is most of it): 330 s was too short on an H200,
    # 2026-11-30.
    step 460 python3 tools/bench_train.py --presets gdn_swa-0.4b lalte-0.4b --batch 8 12 16 \
      --steps 5 --warmup 2 --lte_kept_fraction 0.125 --json "$dest/train_0_4b.json"
    ;;
  batches14)
    step 450 python3 tools/bench_train.py --presets gdn_swa-1.4b lalte-1.4b --batch 4 8 \
      --steps 5 --warmup 2 --lte_kept_fraction 0.125 --json "$dest/train_1_4b.json"
    ;;
  layercopies)
    # The scanned layer groups' per-layer buffers (the saved activations stacked over the
    # groups): the scanned step, XLA's dynamic-slice fusion (library GEMMs reading and writing
    # their slice of a stacked buffer in place instead of through a copy), the same without
    # command buffers (which can keep XLA from that fusion), and the groups unrolled; rounds in
    # alternation (the second is cut by --budget on a 10-minute slot).
    train=(python3 tools/bench_train.py --presets gdn_swa-0.4b lalte-0.4b --batch 4 --steps 5
           --warmup 2 --lte_kept_fraction 0.125)
    fusion=--xla_gpu_enable_dynamic_slice_fusion=true
    for round in 1 2; do
      step 90 "${train[@]}" --scan_layers true --json "$dest/scanned_$round.json"
      step 90 "${train[@]}" --scan_layers true --xla_flags="$fusion" \
        --json "$dest/dsfusion_$round.json"
      step 90 "${train[@]}" --scan_layers true --xla_flags="$fusion --xla_gpu_enable_command_buffer=" \
        --json "$dest/dsfusion_nographs_$round.json"
      step 150 "${train[@]}" --scan_layers false --json "$dest/unrolled_$round.json"
    done
    ;;
  ltesweep)
    # The kernels' block sizes were tuned with 4 query heads per KV head (lalte-1.4b); lalte-0.4b
    # has one, which makes each dk/dv program 4x shorter and the kept-list kernel's grid small.
    step 330 python3 tools/bench_attention.py --sweep --heads 16 16 --lte 769 512 --no-checks \
      --no-fla --iters 10 --only "LTE train" "SWA-1024 defaults" --json "$dest/ltesweep.json"
    ;;
  shortconv)
    step 100 python3 -m pytest -q -m gpu tests/pallas_kernels/test_short_conv.py -p no:cacheprovider
    step 200 python3 tools/bench_short_conv.py --sweep --json "$dest/short_conv.json"
    ;;
  ab)
    [ -d "${AB_BASE:-}" ] || { echo "ab: set AB_BASE to the other tree's directory" >&2; exit 2; }
    step 560 python3 tools/bench_train_ab.py --base "$AB_BASE" --rounds 2 \
      --json "$dest/ab.json" -- --presets gdn_swa-0.4b lalte-0.4b --batch 8 --steps 5 \
      --warmup 2 --lte_kept_fraction 0.125
    ;;
  servingab)
    [ -d "${AB_BASE:-}" ] || { echo "servingab: set AB_BASE to the other tree's directory" >&2; exit 2; }
    base=$(cd "$AB_BASE" && pwd) || exit 2
    read -r -a serving <<<"${SERVINGAB_ARGS:---presets lalte-1.4b --batches 32 --prompts 4096 --steps 10 --warmup 3 --prefill-iters 1 --generate 129 256}"
    # Base first in round 0, this tree first in round 1 (a steady drift cancels over the two).
    # The other tree imports its own lalte_jax and pallas_kernels: its directory replaces this
    # one on the path.
    run_base() { (cd "$base" && PYTHONPATH=${PYTHONPATH//$PWD/$base} step 170 python3 \
      tools/bench_serving.py "${serving[@]}" --json "$dest/base_$1.json"); }
    run_this() { step 170 python3 tools/bench_serving.py "${serving[@]}" \
      --json "$dest/this_$1.json"; }
    run_base 0; run_this 0; run_this 1; run_base 1
    python3 - "$dest" <<'SUMMARY' | tee -a "$log"
import json, pathlib, sys
dest = pathlib.Path(sys.argv[1])
print("| round | model | batch | base ms / token | this ms / token | this / base |")
print("|---|---|---:|---:|---:|---:|")
for round_ in (0, 1):
  runs = {tree: dest / f"{tree}_{round_}.json" for tree in ("base", "this")}
  if not all(path.is_file() for path in runs.values()):
    continue
  rows = {tree: json.loads(path.read_text())["rows"] for tree, path in runs.items()}
  for base, this in zip(rows["base"], rows["this"]):
    b, t = base.get("generate_ms_per_token"), this.get("generate_ms_per_token")
    ratio = f"{t / b:.4f}" if b and t else "-"
    print(f"| {round_} | {this['model']} | {this['batch']} | {b} | {t} | {ratio} |")
SUMMARY
    ;;
  tma)
    step 300 python3 tools/probe_tma_attention.py --json "$dest/tma.json"
    ;;
  longprompt)
    # XLA's memory analysis of the compiled prefill and decode step gives each row's memory.
    serving=(python3 tools/bench_serving.py --presets gdn-1.4b gdn_swa-1.4b lalte-1.4b \
      --batches 1 --prompts 65536 --steps 3 --warmup 1 --prefill-iters 2)
    step 150 "${serving[@]}" --json "$dest/prefill_whole.json"
    step 150 "${serving[@]}" --prefill-chunk-tokens 8192 --json "$dest/prefill_chunks.json"
    ;;
  anchors)
    # Ours first (JAX, then the process ends and frees the GPU), then FLA's PyTorch training of
    # the same presets, each side at the batches where its fastest lies (FLA's eager step is
    # launch-bound at 4 sequences), with the ratios to ours (the tool writes its JSON after every
    # row), then FLA's torch.compile mode at 8 if the budget leaves time (slower than eager in
    # every run so far). Needs FLA's wheels (--wheels). FLA autotunes for ~4 min on its first
    # step and keeps the results in TRITON_CACHE_DIR, so later rows and stages start faster.
    step 200 python3 tools/bench_train.py --presets gdn-0.4b gdn_swa-0.4b --batch 8 12 --steps 5 \
      --warmup 2 --json "$dest/train_ours.json"
    step 400 python3 tools/bench_train_fla.py --presets gdn-0.4b gdn_swa-0.4b --modes eager \
      --batch 8 16 --ours "$dest/train_ours.json" --json "$dest/train_fla.json"
    step 300 python3 tools/bench_train_fla.py --presets gdn-0.4b gdn_swa-0.4b --modes compile \
      --batch 8 --ours "$dest/train_ours.json" --json "$dest/train_fla_compile.json"
    ;;
  decode)
    # Ours (generate.DECODE_COMPILER_OPTIONS: every kernel run a CUDA graph) and XLA's default
    # minimum graph size (5). (XLA's dot strength reduction, which turns a one-row projection
    # into a multiply and a reduction, has no switch in jax 0.11.2's XLA: neither a compile
    # option nor an XLA_FLAGS flag of that name exists.)
    for batch in 32 1; do
      common=(--presets lalte-1.4b gdn_swa-1.4b --contexts 4096 --batch "$batch"
              --param-dtype bfloat16)
      step 100 python3 tools/bench_decode.py "${common[@]}" --json "$dest/decode_b$batch.json"
      step 100 python3 tools/bench_decode.py "${common[@]}" \
        --compiler-option xla_gpu_graph_min_graph_size=5 \
        --json "$dest/decode_b${batch}_graphs5.json"
    done
    # The GDN layer's recurrent step alone against the copy, over its launch parameters.
    step 180 python3 tools/bench_gdn_decode.py --presets lalte-1.4b --sweep \
      --json "$dest/gdn_decode.json"
    ;;
  nsadecode)
    step 200 python3 -m pytest -q -m gpu tests/pallas_kernels/test_nsa_pallas.py -k decode \
      -p no:cacheprovider
    step 150 python3 tools/bench_nsa.py --no-fla --no-parity --no-training \
      --json "$dest/nsa_decode.json"
    step 150 python3 tools/bench_decode.py --presets lansa-1.4b --contexts 4096 65536 --batch 32 \
      --param-dtype bfloat16 --json "$dest/decode_lansa.json"
    ;;
  nsatrain)
    step 200 python3 -m pytest -q -m gpu tests/pallas_kernels/test_nsa_pallas.py \
      -p no:cacheprovider
    step 150 python3 tools/bench_nsa.py --sweep --no-fla --no-parity --no-decode --lengths 4096 \
      --json "$dest/nsa_sweep.json"
    step 170 python3 tools/bench_train.py --presets lansa-0.4b gdn_swa-0.4b --batch 4 --steps 5 \
      --warmup 2 --json "$dest/train.json"
    ;;
  serving)
    # The serving table (tools/bench_serving.py): prefill tokens/s, decode ms per step against
    # the step's HBM-bytes bound at the copy bandwidth, memory; by default the 1.4b presets of the
    # decode targets at a 4K prompt, batch 32 and 1. SERVING_ARGS replaces the selection, e.g.
    # "--presets lalte-1.4b --prompts 65536 --batches 32" or, with --wheels holding FLA's,
    # "--compare-fla --presets gdn_swa-1.4b gdn-1.4b --batches 32 --prompts 4096".
    # shellcheck disable=SC2086  # SERVING_ARGS is a list of arguments
    step 580 python3 tools/bench_serving.py \
      ${SERVING_ARGS:---presets lalte-1.4b gdn_swa-1.4b gdn-1.4b --batches 32 1 --prompts 4096} \
      --json "$dest/serving.json"
    ;;
  decodeflags)
    # XLA's launch-overlap options on the decode step and `generate`: the serving flags as set
    # (concurrent regions in the CUDA graphs, lalte_jax.xla_flags.SERVING_GPU), without them, and
    # with programmatic dependent launch (a kernel's start overlapping its predecessor's tail,
    # Hopper) on top, in alternation; lalte-1.4b and gdn_swa-1.4b at batch 32 and 1 after a 4K
    # prompt. The first run also compiles the kernels (~150 s cold).
    serving=(python3 tools/bench_serving.py --presets lalte-1.4b gdn_swa-1.4b --batches 32 1
             --prompts 4096 --steps 10 --warmup 3 --prefill-iters 1 --generate 129 256)
    for flags in "" --xla_gpu_graph_enable_concurrent_region=false --xla_gpu_enable_pdl=true ""; do
      name=${flags:-default}; name=${name#--}; name=${name%%=*}
      step 150 env XLA_FLAGS="${XLA_FLAGS:-} $flags" "${serving[@]}" \
        --json "$dest/serving_${name}_$(date +%s).json"
    done
    ;;
  routerprofile)
    # Which kernels take the LTE router's time in the training step: its variants timed at the
    # lalte-0.4b shapes with 8 sequences, then the Pallas and XLA forms with every activation
    # kept (the step's remat "none") traced by kernel (bench_router --profile).
    step 300 python3 tools/bench_router.py --presets lalte-0.4b --batch 8 --profile \
      --json "$dest/router_profile.json"
    ;;
  decodegemm)
    # The decode step's GEMMs (M = the batch's rows) under XLA's GEMM backends: its autotuned
    # Triton GEMM fusions (default), cuBLAS, cuBLASLt, then the default again; lalte-1.4b at 32
    # rows after a 4K prompt (DECODEGEMM_ARGS: other bench_serving arguments). At 3e6acc3-184b9a1
    # the GEMMs ran at 1.9-3.3 TB/s against a 3.2 TB/s copy (o_proj's the slowest), 1.17 ms of
    # GPU time a step for 0.81 ms of weight bytes.
    read -r -a serving <<<"${DECODEGEMM_ARGS:---presets lalte-1.4b --batches 32 --prompts 4096 --steps 10 --warmup 3 --prefill-iters 1 --generate 129 256}"
    for flags in "" --xla_gpu_enable_triton_gemm=false \
        "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_cublaslt=true" ""; do
      name=${flags:-default}; name=${name//--xla_gpu_/}; name=${name// /_}; name=${name//=/-}
      step 140 env XLA_FLAGS="${XLA_FLAGS:-} $flags" python3 tools/bench_serving.py "${serving[@]}" \
        --json "$dest/serving_${name}_$(date +%s%N).json"
    done
    python3 - "$dest" <<'SUMMARY' | tee -a "$log"
import json, pathlib, sys
print("| XLA flags | model | batch | generate ms / token | pipelined ms / step | bound ms |")
print("|---|---|---:|---:|---:|---:|")
for path in sorted(pathlib.Path(sys.argv[1]).glob("serving_*.json"), key=lambda p: p.stat().st_mtime):
  for row in json.loads(path.read_text())["rows"]:
    print(f"| {path.stem.split('_', 1)[1].rsplit('_', 1)[0]} | {row['model']} | {row['batch']} |"
          f" {row.get('generate_ms_per_token')} | {row.get('decode_pipelined_ms')} |"
          f" {row.get('bound_ms')} |")
SUMMARY
    ;;
  genloop)
    # Where `generate`'s loop spends more per step than decode steps sent back to back: the GPU
    # test that the loop, compiled for the GPU at 0.4b shapes, copies no cache or weight, then
    # the loop's GPU time per token by op class next to the pipelined steps (lalte-1.4b B32
    # after 4K).
    step 200 python3 -m pytest -q -m gpu tests/lalte_jax/test_decode_in_place.py -k generate \
      -p no:cacheprovider
    step 380 python3 tools/bench_serving.py --presets lalte-1.4b --batches 32 --prompts 4096 \
      --generate 129 256 --profile-generate --json "$dest/serving_generate.json"
    ;;
  flaprefill)
    step 600 python3 tools/bench_prefill.py --fla --lengths 4096 --json "$dest/prefill_4k.json"
    ;;
  multigpu)
    # The trainer over 1, 2 and 4 GPUs on the data mesh (N processes and one process, 4 sequences
    # of 4096 per GPU, lalte-0.4b, gdn_swa-0.4b, lalte-1.4b as far as SCALING_S seconds reach; the
    # tool skips what cannot finish and writes its JSON after every case; SCALING_ARGS adds
    # arguments), a bf16 lalte-1.4b FSDP checkpoint of 4 processes resumed by 2 and by 1 process
    # on the same GPUs (float32 steps take minutes to compile), then the Pallas kernels inside
    # shard_map (lalte_jax/sharding.py).
    scaling_s=${SCALING_S:-480}
    if ((budget_s > 0)); then
      left=$((budget_s - ($(date +%s) - start) - 30))
      ((left < scaling_s)) && scaling_s=$left
      ((scaling_s < 1)) && scaling_s=1
    fi
    # shellcheck disable=SC2086  # SCALING_ARGS: extra words, e.g. "--presets X --gpus 1,4"
    step $((scaling_s + 30)) python3 tools/bench_scaling.py --budget-s "$scaling_s" \
      --out "$dest/runs" --json "$dest/scaling.json" ${SCALING_ARGS:-}
    step 330 python3 tools/bench_scaling.py --presets "" --mesh fsdp --batch-per-gpu 1 \
      --reshard lalte-1.4b --reshard-dtype bfloat16 --reshard-seq-len 1024 --reshard-steps 2,2 \
      --reshard-same-gpus --case-timeout-s 140 --out "$dest/runs" --json "$dest/reshard.json"
    step 200 python3 -m pytest -q -m gpu tests/lalte_jax/test_sharding.py -p no:cacheprovider
    ;;
  determinism)
    # --deterministic: every trainer process with reproducible=true (xla_flags.REPRODUCIBLE_GPU).
    layouts=(python3 tools/bench_scaling.py --presets lalte-0.4b,lalte-1.4b --gpus 4 --steps 5
             --warmup 2 --case-timeout-s 100 --deterministic --out "$dest/runs")
    step 220 "${layouts[@]}" --json "$dest/deterministic.json"
    layouts_equal=$?
    step 360 python3 tools/bench_scaling.py --presets "" --mesh fsdp --batch-per-gpu 1 \
      --reshard lalte-1.4b --reshard-dtype bfloat16 --reshard-seq-len 1024 --reshard-steps 2,2 \
      --reshard-to 4,2,1 --reshard-same-gpus --deterministic --case-timeout-s 150 \
      --out "$dest/runs" --json "$dest/reshard_deterministic.json"
    # When the layouts still differ: NCCL's algorithm, protocol and channel count fixed too.
    ((layouts_equal == 0)) || step 200 env NCCL_ALGO=Ring NCCL_PROTO=Simple NCCL_MIN_NCHANNELS=1 \
      NCCL_MAX_NCHANNELS=1 "${layouts[@]}" --json "$dest/deterministic_nccl_fixed.json"
    ;;
esac
echo "### stage $stage done in $(($(date +%s) - start))s" >>"$log"
tail -n 60 "$log"
