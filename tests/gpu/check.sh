#!/bin/bash
# tests/gpu/check.sh - the GPU check of the CUDA backend (issues 7 and 19),
# one short run (under 3 minutes with the build on a 16-core machine; every
# step has its own timeout), a PASS or FAIL line per check as it goes:
#   1. builds psd, workerd and the GPU tools into build/gpu (make -j);
#   2. cuda_vs_cpu: CUDA (model_cuda.cu) against the CPU (model_cpu.c) on fresh
#      random inputs: every layer type alone (outputs, input and parameter
#      gradients), the dropout masks bit for bit, small CNNs and the full cnn
#      step (loss, every gradient), the range interface on splits, evaluate,
#      MLPs with pinned and malloc'd buffers and staged batches (max-norm
#      relative error <= 1e-4, TF32 off, outputs poisoned with NaN first);
#   3. the cuBLAS sgemm rate (8192^3, FP32) and the training step's steps/s for
#      mlp:1024,1024 at batch 256 and 4096 (and 4096 with --tf32), as a
#      fraction of that rate, with the host buffers pinned (model_host_alloc,
#      as the worker's); 4096 also with malloc'd ones (copied through the
#      backend's staging buffers), for comparison; and the step's sgemm calls
#      alone (its ceiling); and 4096 as workerd --local steps (two batches in
#      turn, the host's SGD update between steps) without and with each batch
#      staged ahead (model_stage_batch: its copy overlaps the update): what
#      staging buys; the cnn step at batch 100 on the GPU (TF32 off and on)
#      and on the CPU (1 thread and every core): steps/s and the ratio;
#   4. the example's model (784-100-10, batch 100) trained by a cuda worker
#      against a local psd: the loss must fall; a small CNN --local on the
#      GPU: the loss must fall;
#   5. mlp:1024,1024 at batch 4096: one cuda worker against a local psd vs
#      the same worker --local (steps/s ratio; the target is >= 0.8);
# then prints a table and writes it to bench/results/gpu-<UTC date>.md, and a
# last line "gpu-check: N passed, M failed".
#
# Exit status: 0 every check passed; 1 a check failed (the table says which);
# 77 no CUDA device visible (the build succeeded; nothing else ran).
#
# Environment: DATA_DIR (default /usr/share/datasets/fashion-mnist; where it is
# missing a synthetic MNIST-format set is generated), GPU_CHECK_BUILD (build
# folder, default build/gpu), GPU_CHECK_PREBUILT=1 (use the binaries already in
# $GPU_CHECK_BUILD/bin, e.g. built elsewhere and copied, instead of building),
# GPU_CHECK_OUT (default bench/results),
# GPU_CHECK_DEVICE=cpu: a dry run of this script on a machine without a GPU
# (the CUDA-only steps are skipped, training uses --device=cpu and few steps).
set -u -o pipefail
cd "$(dirname "$0")/../.." || exit 1

B=${GPU_CHECK_BUILD:-build/gpu}
BIN=$B/bin
DEVICE=${GPU_CHECK_DEVICE:-cuda}
DATA=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
OUTDIR=${GPU_CHECK_OUT:-bench/results}
LOGS=$B/check-logs
JOBS=$(nproc 2>/dev/null || echo 4)
T0=$(date +%s)
FAILS=0
ROWS=()
PIDS=()

mkdir -p "$LOGS" || exit 1
log() { printf '[gpu-check +%ss] %s\n' "$(($(date +%s) - T0))" "$*"; }
PASSES=0
row() { ROWS+=("| $1 | $2 | $3 |"); }
bad() { # what, detail
    FAILS=$((FAILS + 1))
    log "FAIL: $1: $2"
    row "$1" "**FAIL**" "$2"
}
good() { # what, result, detail: a passed check's row and its PASS line
    PASSES=$((PASSES + 1))
    log "PASS: $1: $2${3:+ ($3)}"
    row "$1" "$2" "$3"
}
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
}
trap cleanup EXIT
# the value of key=... in a file's last line that has it
kv() { grep -o "$1=[0-9.e+-]*" "$2" | tail -1 | cut -d= -f2; }
# a / b, or "n/a"
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "" || b + 0 == 0) print "n/a"; else printf "%.3f", a / b }'; }

if [ "$DEVICE" != cuda ] && [ "$DEVICE" != cpu ]; then
    echo "check.sh: GPU_CHECK_DEVICE must be cuda or cpu, got '$DEVICE'" >&2
    exit 2
fi

# ---- 1. build ----
if [ "${GPU_CHECK_PREBUILT:-0}" = 1 ]; then
    for p in "$BIN/psd" "$BIN/workerd" "$BIN/cuda_vs_cpu" "$BIN/gpu_bench" "$B/synth_idx"; do
        if [ ! -x "$p" ]; then
            log "FAIL: GPU_CHECK_PREBUILT=1 but $p is missing"
            exit 1
        fi
    done
    log "using the prebuilt binaries in $BIN (GPU_CHECK_PREBUILT=1)"
    row "build" "prebuilt" "$BIN"
else
    NVCC_FOUND=$(ls /usr/local/cuda/bin/nvcc 2>/dev/null || command -v nvcc || true)
    if [ -z "$NVCC_FOUND" ]; then
        log "FAIL: no nvcc (neither /usr/local/cuda/bin/nvcc nor on PATH): cannot build the CUDA backend"
        exit 1
    fi
    log "building into $B with $NVCC_FOUND, make -j$JOBS (log: $LOGS/build.log)"
    if ! timeout 400 make -j"$JOBS" BUILD="$B" BIN="$BIN" CUDA=1 \
            "$BIN/psd" "$BIN/workerd" "$BIN/cuda_vs_cpu" "$BIN/gpu_bench" > "$LOGS/build.log" 2>&1; then
        tail -40 "$LOGS/build.log"
        log "FAIL: the build failed (above: the end of $LOGS/build.log)"
        exit 1
    fi
    if ! cc -O2 -std=c11 -Wall -Wextra -o "$B/synth_idx" tests/gpu/synth_idx.c >> "$LOGS/build.log" 2>&1; then
        log "FAIL: tests/gpu/synth_idx.c did not build"
        exit 1
    fi
    log "built in $(($(date +%s) - T0)) s"
    row "build" "ok" "$(($(date +%s) - T0)) s, make -j$JOBS, CUDA=1"
fi
missing=$(ldd "$BIN/psd" "$BIN/workerd" "$BIN/cuda_vs_cpu" "$BIN/gpu_bench" 2>&1 | grep "not found" | sort -u)
if [ -n "$missing" ]; then
    echo "$missing"
    log "FAIL: shared libraries missing on this machine (above): install them (make deps) and rerun"
    exit 1
fi

GPU_DESC=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
[ -n "$GPU_DESC" ] || GPU_DESC="(nvidia-smi gave nothing)"
log "nvidia-smi: $GPU_DESC; CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-(unset)}"

# ---- is there a device? ----
"$BIN/cuda_vs_cpu" --probe > "$LOGS/probe.log" 2>&1
probe=$?
if [ $probe -eq 77 ]; then
    if [ "$DEVICE" = cuda ]; then
        cat "$LOGS/probe.log"
        log "SKIPPED: no CUDA device visible to this process; the build is fine; exit 77"
        exit 77
    fi
    log "dry run (GPU_CHECK_DEVICE=cpu): $(cat "$LOGS/probe.log")"
elif [ $probe -ne 0 ]; then
    cat "$LOGS/probe.log"
    log "FAIL: cuda_vs_cpu --probe exited $probe"
    exit 1
fi

# ---- 2. CUDA against the CPU ----
if [ "$DEVICE" = cuda ]; then
    log "cuda_vs_cpu (log: $LOGS/cuda_vs_cpu.log)"
    timeout 180 "$BIN/cuda_vs_cpu" > "$LOGS/cuda_vs_cpu.log" 2>&1
    rc=$?
    grep -v '^PASS' "$LOGS/cuda_vs_cpu.log" # the PASS lines stay in the log
    worst=$(grep -o "rel err [0-9.e+-]*" "$LOGS/cuda_vs_cpu.log" | awk '{ if ($3 + 0 > m) m = $3 + 0 } END { printf "%.2e", m }')
    if [ $rc -eq 0 ] && grep -q "all agree" "$LOGS/cuda_vs_cpu.log"; then
        good "CUDA vs CPU, every layer and tensor (limit 1e-4)" "ok" "$(grep -o '[0-9]* passed, [0-9]* failed' "$LOGS/cuda_vs_cpu.log" | tail -1); worst rel err $worst; $(head -1 "$LOGS/cuda_vs_cpu.log" | cut -d';' -f2 | sed 's/^ //')"
    else
        grep '^FAIL' "$LOGS/cuda_vs_cpu.log" | head -20
        bad "CUDA vs CPU, every layer and tensor (limit 1e-4)" "exit $rc, $(grep -o '[0-9]* passed, [0-9]* failed' "$LOGS/cuda_vs_cpu.log" | tail -1), worst rel err $worst; see $LOGS/cuda_vs_cpu.log"
    fi
else
    row "CUDA vs CPU" "skipped" "dry run without a device"
fi

# ---- 3. sgemm rate and step speed ----
SGEMM=""
if [ "$DEVICE" = cuda ]; then
    log "cuBLAS sgemm 8192^3"
    if timeout 60 "$BIN/gpu_bench" sgemm 8192 2 > "$LOGS/sgemm.log" 2>&1; then
        cat "$LOGS/sgemm.log"
        SGEMM=$(kv sgemm_gflops "$LOGS/sgemm.log")
        good "cuBLAS sgemm 8192^3 (FP32)" "$SGEMM GFLOP/s" "the reference rate below"
    else
        cat "$LOGS/sgemm.log"
        bad "cuBLAS sgemm" "gpu_bench sgemm failed; see $LOGS/sgemm.log"
    fi
    LOCAL_SPS_RUN="" STAGED_SPS_RUN=""
    for spec in "256:" "4096:" "4096:tf32" "4096:plain" "4096:local" "4096:local stage"; do
        bsz=${spec%%:*}
        mode=${spec#*:}
        name="step mlp:1024,1024 batch $bsz${mode:+ ($mode)}"
        f="$LOGS/step-$bsz${mode:+-${mode// /-}}.log"
        log "$name"
        # shellcheck disable=SC2086 # $mode: zero, one or two words
        if timeout 60 "$BIN/gpu_bench" step mlp:1024,1024 "$bsz" 2 $mode > "$f" 2>&1; then
            cat "$f"
            sps=$(kv steps_per_s "$f")
            [ "$mode" = local ] && LOCAL_SPS_RUN=$sps
            [ "$mode" = "local stage" ] && STAGED_SPS_RUN=$sps
            gf=$(kv gflops "$f")
            fr=$(ratio "$gf" "$SGEMM")
            hb=$(grep -o "host_buffers=[a-z]*" "$f" | tail -1 | cut -d= -f2)
            tgt=""
            if [ "$bsz" = 4096 ] && [ -z "$mode" ]; then
                tgt=$(awk -v r="$fr" 'BEGIN { print (r != "n/a" && r + 0 >= 0.6) ? "; target >= 0.6 met" : "; target >= 0.6 NOT met" }')
            fi
            good "$name" "$sps steps/s" "$gf GFLOP/s = $fr of sgemm (host copies included, ${hb:-?} host buffers)$tgt"
        else
            cat "$f"
            bad "$name" "gpu_bench step failed; see $f"
        fi
    done
    if [ -n "$LOCAL_SPS_RUN" ] && [ -n "$STAGED_SPS_RUN" ]; then
        row "staging the next batch, batch 4096 (local steps)" "x $(ratio "$STAGED_SPS_RUN" "$LOCAL_SPS_RUN")" \
            "steps/s staged / unstaged ($STAGED_SPS_RUN / $LOCAL_SPS_RUN); > 1: the batch's copy hidden behind the update"
    fi
    for bsz in 256 4096; do
        name="only the step's sgemms, batch $bsz"
        f="$LOGS/gemms-$bsz.log"
        log "$name"
        if timeout 60 "$BIN/gpu_bench" gemms 784,1024,1024,10 "$bsz" 2 > "$f" 2>&1; then
            cat "$f"
            gf=$(kv gflops "$f")
            good "$name" "$(kv steps_per_s "$f") steps/s" "$gf GFLOP/s = $(ratio "$gf" "$SGEMM") of sgemm: the step's ceiling without copies and kernels"
        else
            cat "$f"
            bad "$name" "gpu_bench gemms failed; see $f"
        fi
    done
    # the tutorial's CNN at batch 100: GPU (TF32 off, on) against the CPU backend
    CNN_GPU=""
    for mode in "" tf32; do
        name="cnn step batch 100 on the GPU${mode:+ ($mode)}"
        f="$LOGS/cnn-gpu${mode:+-$mode}.log"
        log "$name"
        # shellcheck disable=SC2086 # $mode: zero or one word
        if timeout 60 "$BIN/gpu_bench" step cnn 100 2 $mode > "$f" 2>&1; then
            cat "$f"
            sps=$(kv steps_per_s "$f")
            [ -z "$mode" ] && CNN_GPU=$sps
            gf=$(kv gflops "$f")
            good "$name" "$sps steps/s" "$gf GFLOP/s = $(ratio "$gf" "$SGEMM") of sgemm, pinned host buffers"
        else
            cat "$f"
            bad "$name" "gpu_bench step cnn failed; see $f"
        fi
    done
    for threads in 1 "$JOBS"; do
        name="cnn step batch 100 on the CPU backend, $threads thread(s)"
        f="$LOGS/cnn-cpu-$threads.log"
        log "$name"
        if timeout 60 "$BIN/gpu_bench" cpu cnn 100 3 "$threads" > "$f" 2>&1; then
            cat "$f"
            sps=$(kv steps_per_s "$f")
            good "$name" "$sps steps/s" "GPU / this = $(ratio "$CNN_GPU" "$sps")"
        else
            cat "$f"
            bad "$name" "gpu_bench cpu cnn failed; see $f"
        fi
    done
else
    row "sgemm and step benchmarks" "skipped" "dry run without a device"
fi

# ---- data ----
if [ -f "$DATA/train-images-idx3-ubyte.gz" ] || [ -f "$DATA/train-images-idx3-ubyte" ]; then
    DATA_NOTE="$DATA"
else
    log "no MNIST-format data in $DATA: generating a synthetic set in $B/synth-data"
    mkdir -p "$B/synth-data" && "$B/synth_idx" "$B/synth-data" || { log "FAIL: synth_idx"; exit 1; }
    DATA="$B/synth-data"
    DATA_NOTE="synthetic (tests/gpu/synth_idx.c; $DATA_DIR missing)"
fi
log "data: $DATA_NOTE"

# start psd on a free port; sets PSD_PID and PSD_PORT, or returns 1
start_psd() { # log file
    : > "$1"
    "$BIN/psd" --port=0 --logdir= > "$1" 2>&1 &
    PSD_PID=$!
    PIDS+=("$PSD_PID")
    for _ in $(seq 100); do
        PSD_PORT=$(sed -n 's/^psd: listening on http:\/\/.*:\([0-9]*\)$/\1/p' "$1" | head -1)
        [ -n "$PSD_PORT" ] && return 0
        kill -0 "$PSD_PID" 2>/dev/null || break
        sleep 0.1
    done
    cat "$1"
    return 1
}
stop_psd() {
    # the chief asked it to stop at the end; make sure
    for _ in $(seq 50); do kill -0 "$PSD_PID" 2>/dev/null || return 0; sleep 0.1; done
    kill "$PSD_PID" 2>/dev/null
    wait "$PSD_PID" 2>/dev/null
}
# one worker (the chief) against psd: args...; output in $WLOG
run_worker() {
    timeout 240 "$BIN/workerd" --device="$DEVICE" --job_name=worker --task_index=0 \
        --ps_hosts="127.0.0.1:$PSD_PORT" --worker_hosts=127.0.0.1:1 --data_dir="$DATA" "$@" > "$WLOG" 2>&1
}
last_sps() { grep -o "[0-9.]* steps/s" "$1" | tail -1 | cut -d' ' -f1; }

# ---- 4. the example's model against a local psd: the loss falls ----
EX_STEPS=2000
[ "$DEVICE" = cpu ] && EX_STEPS=600
name="example 784-100-10 batch 100, $DEVICE worker + psd, $EX_STEPS steps"
log "$name"
WLOG="$LOGS/train-example.log"
if start_psd "$LOGS/psd-example.log"; then
    run_worker --train_steps=$EX_STEPS --log_every=100
    rc=$?
    stop_psd
    cat "$WLOG"
    # falls: the loss at step 100 (the start is ln 10 = 2.30) against the
    # final validation cross-entropy, which must be < 0.8 x it and < 1.15
    first=$(grep -o "(global step [0-9]*) loss [0-9.]*" "$WLOG" | head -1 | awk '{ print $NF }')
    last=$(grep -o "validation cross-entropy [0-9.]*" "$WLOG" | tail -1 | awk '{ print $NF }')
    acc=$(grep -o "test accuracy [0-9.]*" "$WLOG" | tail -1 | awk '{ print $NF }')
    if [ $rc -eq 0 ] && grep -q "using the $DEVICE backend" "$WLOG" && [ -n "$first" ] && [ -n "$last" ] &&
        awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < 0.8 * a && b < 1.15) }'; then
        good "$name" "ok" "loss at step 100 $first -> validation $last, test accuracy ${acc:-?}, $(last_sps "$WLOG") steps/s"
    else
        bad "$name" "exit $rc, loss at step 100 ${first:-?} -> validation ${last:-?} (must be < 0.8x and < 1.15); see $WLOG"
    fi
else
    bad "$name" "psd did not start; see $LOGS/psd-example.log"
fi

# ---- 4b. a small CNN --local on the device: the loss falls ----
CNN_STEPS=600
[ "$DEVICE" = cpu ] && CNN_STEPS=200
CNN_SPEC=conv:5x5x16,pool:2,dense:64,dense:10
name="$CNN_SPEC batch 100 --local on $DEVICE, $CNN_STEPS steps"
log "$name"
WLOG="$LOGS/train-cnn-local.log"
timeout 240 "$BIN/workerd" --device="$DEVICE" --local --model="$CNN_SPEC" --data_dir="$DATA" \
    --train_steps=$CNN_STEPS --log_every=50 > "$WLOG" 2>&1
rc=$?
cat "$WLOG"
first=$(grep -o "step [0-9]* loss [0-9.]*" "$WLOG" | head -1 | awk '{ print $NF }')
last=$(grep -o "validation cross-entropy [0-9.]*" "$WLOG" | tail -1 | awk '{ print $NF }')
acc=$(grep -o "test accuracy [0-9.]*" "$WLOG" | tail -1 | awk '{ print $NF }')
if [ $rc -eq 0 ] && grep -q "using the $DEVICE backend" "$WLOG" && [ -n "$first" ] && [ -n "$last" ] &&
    awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < 0.8 * a && b < 1.15) }'; then
    good "$name" "ok" "loss at step 50 $first -> validation $last, test accuracy ${acc:-?}, $(last_sps "$WLOG") steps/s"
else
    bad "$name" "exit $rc, loss at step 50 ${first:-?} -> validation ${last:-?} (must be < 0.8x and < 1.15); see $WLOG"
fi

# ---- 5. big model: worker + psd vs --local ----
BIG_STEPS=300
[ "$DEVICE" = cpu ] && BIG_STEPS=4
BIG=("--model=mlp:1024,1024" --batch_size=4096 "--train_steps=$BIG_STEPS" --log_every=100)
name="mlp:1024,1024 batch 4096, $BIG_STEPS steps: $DEVICE worker + psd"
log "$name"
WLOG="$LOGS/train-big-psd.log"
PS_SPS=""
if start_psd "$LOGS/psd-big.log"; then
    run_worker "${BIG[@]}"
    rc=$?
    stop_psd
    cat "$WLOG"
    PS_SPS=$(last_sps "$WLOG")
    if [ $rc -eq 0 ] && [ -n "$PS_SPS" ]; then
        good "$name" "$PS_SPS steps/s" ""
    else
        bad "$name" "exit $rc; see $WLOG"
        PS_SPS=""
    fi
else
    bad "$name" "psd did not start; see $LOGS/psd-big.log"
fi
name="mlp:1024,1024 batch 4096, $BIG_STEPS steps: the same worker --local"
log "$name"
WLOG="$LOGS/train-big-local.log"
timeout 240 "$BIN/workerd" --device="$DEVICE" --local --data_dir="$DATA" "${BIG[@]}" > "$WLOG" 2>&1
rc=$?
cat "$WLOG"
LOCAL_SPS=$(last_sps "$WLOG")
if [ $rc -eq 0 ] && [ -n "$LOCAL_SPS" ]; then
    r=$(ratio "$PS_SPS" "$LOCAL_SPS")
    met=$(awk -v r="$r" 'BEGIN { print (r != "n/a" && r + 0 >= 0.8) ? "target >= 0.8 met" : "target >= 0.8 NOT met" }')
    good "$name" "$LOCAL_SPS steps/s" "worker + psd / --local = $r ($met)"
else
    bad "$name" "exit $rc; see $WLOG"
fi

# ---- the table ----
STAMP=$(date -u +%Y-%m-%d-%H%M)
mkdir -p "$OUTDIR"
OUT="$OUTDIR/gpu-$STAMP.md"
[ "$DEVICE" = cpu ] && OUT="$LOGS/gpu-dryrun-$STAMP.md"
{
    echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "- device: $GPU_DESC (--device=$DEVICE)"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' + uncommitted changes')"
    echo "- data: $DATA_NOTE"
    echo "- total time: $(($(date +%s) - T0)) s; $PASSES passed, $FAILS failed"
    echo
    echo "| check | result | notes |"
    echo "|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
} > "$OUT"
echo
cat "$OUT"
echo
log "written to $OUT"
if grep -q '^FAIL' "$LOGS/cuda_vs_cpu.log" 2>/dev/null; then # again here, at the end of the output
    echo "cuda_vs_cpu's failures ($LOGS/cuda_vs_cpu.log):"
    grep '^FAIL' "$LOGS/cuda_vs_cpu.log" | head -30
fi
echo "gpu-check: $PASSES passed, $FAILS failed in $(($(date +%s) - T0)) s"
if [ $FAILS -gt 0 ]; then
    log "FAILED: $FAILS check(s)"
    exit 1
fi
log "all checks passed"
exit 0
