#!/bin/sh
# make demo: 1 ps, 2 workers (worker 0 is the chief) and an evaluator on this
# machine, training an MLP on Fashion-MNIST in sync mode. Prints where to look
# while it trains and the test accuracy at the end; stops everything it started,
# on Ctrl-C too. Settings can be overridden from the environment, e.g.
#   DEMO_STEPS=1000 make demo
#   MODEL=cnn make demo      (or DEMO_MODEL=cnn: any --model spec; then 550
#                            steps of 2 x 50, one epoch, by default)
set -u
cd "$(dirname "$0")/../.." || exit 2
MODEL=${DEMO_MODEL:-${MODEL:-}}
if [ -n "$MODEL" ]; then
  STEPS=${DEMO_STEPS:-550} BATCH=${DEMO_BATCH:-50}
  MODEL_FLAG="--model=$MODEL" SHOWN="$MODEL" EVAL=20 EVERY=50
else
  STEPS=${DEMO_STEPS:-4000} BATCH=${DEMO_BATCH:-100}
  HIDDEN=${DEMO_HIDDEN:-256,128}
  MODEL_FLAG="--hidden_units=$HIDDEN" SHOWN="784-$HIDDEN-10" EVAL=5 EVERY=250
fi
LR=${DEMO_LR:-0.001}
DATA=${DEMO_DATA:-/usr/share/datasets/fashion-mnist}
LOGDIR=${DEMO_LOGDIR:-logs/demo-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$LOGDIR"

echo "demo: model $SHOWN, Adam $LR, sync, batch $BATCH per worker, $STEPS steps, data $DATA"
if [ "$MODEL" = cnn ]; then
  # Measured on the 2-core build machine: 550 steps of 2 sync workers x 50 and
  # the evaluations took 52 s at load 2 (12 steps/s, 2026-12-03); at load ~25
  # the same ran at 0.56 steps/s, ~20 minutes. The time depends on the load.
  echo "demo: the CNN's $STEPS steps take about $((STEPS / 12 + 10)) s on 2 idle cores (12 steps/s measured), up to 30 times as long on a loaded machine; DEMO_STEPS=N for fewer"
fi
# 1 ps, 2 workers (worker 0, the chief, shown here) and an evaluator, every log
# in $LOGDIR. Ctrl-C or SIGTERM here: the launcher stops everything it started.
sh deploy/local/cluster.sh --ps 1 --workers 2 --sync --evaluator --logdir "$LOGDIR" \
  --chief_flag --export="$LOGDIR/model.safetensors" -- \
  --data_dir="$DATA" "$MODEL_FLAG" --learning_rate="$LR" --optimizer=adam \
  --batch_size="$BATCH" --train_steps="$STEPS" --log_every="$EVERY" --eval_secs="$EVAL" &
CLUSTER=$!
trap 'kill -TERM $CLUSTER 2>/dev/null; wait $CLUSTER; exit 130' INT TERM
wait $CLUSTER
status=0
grep -q "test accuracy" "$LOGDIR/worker0.log" || status=1
tail -n 2 "$LOGDIR/evaluator.log" | sed 's/^/demo: /'
if [ $status = 0 ]; then
  grep "training done" "$LOGDIR/worker0.log" | sed 's/^worker 0: /demo: final model: /'
  echo "demo: done. Model: $LOGDIR/model.safetensors; logs: $LOGDIR/"
else
  echo "demo: training did not finish; see the logs in $LOGDIR/" >&2
fi
exit $status
