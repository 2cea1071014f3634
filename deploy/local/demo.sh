#!/bin/sh
# make demo: 1 ps, 2 workers (worker 0 is the chief) and an evaluator on this
# machine, training an MLP on Fashion-MNIST in sync mode. Prints where to look
# while it trains and the test accuracy at the end; stops everything it started,
# on Ctrl-C too. Settings can be overridden from the environment, e.g.
#   DEMO_STEPS=1000 make demo
set -u
cd "$(dirname "$0")/../.." || exit 2
STEPS=${DEMO_STEPS:-4000}
HIDDEN=${DEMO_HIDDEN:-256,128}
LR=${DEMO_LR:-0.001}
DATA=${DEMO_DATA:-/usr/share/datasets/fashion-mnist}
LOGDIR=${DEMO_LOGDIR:-logs/demo-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$LOGDIR"

echo "demo: model 784-$HIDDEN-10, Adam $LR, sync, batch 100 per worker, $STEPS steps, data $DATA"
# 1 ps, 2 workers (worker 0, the chief, shown here) and an evaluator, every log
# in $LOGDIR. Ctrl-C or SIGTERM here: the launcher stops everything it started.
sh deploy/local/cluster.sh --ps 1 --workers 2 --sync --evaluator --logdir "$LOGDIR" \
  --chief_flag --export="$LOGDIR/model.safetensors" -- \
  --data_dir="$DATA" --hidden_units="$HIDDEN" --learning_rate="$LR" --optimizer=adam \
  --batch_size=100 --train_steps="$STEPS" --log_every=250 &
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
