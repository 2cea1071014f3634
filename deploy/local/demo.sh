#!/bin/sh
# make demo: 1 ps, 2 workers (worker 0 is the chief) and an evaluator on this
# machine, training an MLP on Fashion-MNIST in sync mode. Prints where to look
# while it trains and the test accuracy at the end; stops everything it started,
# on Ctrl-C too. Settings can be overridden from the environment, e.g.
#   DEMO_STEPS=1000 make demo
set -u
cd "$(dirname "$0")/../.."
STEPS=${DEMO_STEPS:-4000}
HIDDEN=${DEMO_HIDDEN:-256,128}
LR=${DEMO_LR:-0.001}
DATA=${DEMO_DATA:-/usr/share/datasets/fashion-mnist}
LOGDIR=${DEMO_LOGDIR:-logs/demo-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$LOGDIR"

free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PS_PORT=$(free_port); W0=$(free_port); W1=$(free_port)
CLUSTER="--ps_hosts=127.0.0.1:$PS_PORT --worker_hosts=127.0.0.1:$W0,127.0.0.1:$W1"
TRAIN="--data_dir=$DATA --hidden_units=$HIDDEN --learning_rate=$LR --optimizer=adam --sync=1 --batch_size=100 --train_steps=$STEPS --log_every=250"

PIDS=""
cleanup() {
  trap - INT TERM EXIT
  for p in $PIDS; do kill "$p" 2>/dev/null; done
  for p in $PIDS; do wait "$p" 2>/dev/null; done
}
trap 'echo; echo "demo: stopping everything"; cleanup; exit 130' INT TERM
trap cleanup EXIT

bin/psd --job_name=ps --task_index=0 $CLUSTER --logdir="$LOGDIR" >"$LOGDIR/ps0.log" 2>&1 &
PIDS="$PIDS $!"
bin/workerd --job_name=worker --task_index=1 $CLUSTER $TRAIN >"$LOGDIR/worker1.log" 2>&1 &
PIDS="$PIDS $!"
bin/workerd --job_name=evaluator --task_index=0 $CLUSTER $TRAIN --eval_secs=5 >"$LOGDIR/evaluator.log" 2>&1 &
PIDS="$PIDS $!"

URL="http://127.0.0.1:$PS_PORT"
cat <<MSG
demo: 1 ps, 2 workers (worker 0 is the chief) and an evaluator; logs in $LOGDIR/
demo: model 784-$HIDDEN-10, Adam $LR, sync, batch 100 per worker, $STEPS steps, data $DATA
demo: while it trains, open $URL/ in a browser (the live page), or look with:
  curl $URL/v1/status
  curl $URL/metrics
  curl '$URL/v1/vars/$( [ "$HIDDEN" = 100 ] && echo hid_w || echo hid0_w )?format=json&count=10'
  curl $URL/v1/vars
MSG

# The chief in the foreground, its lines on the terminal and in its log.
bin/workerd --job_name=worker --task_index=0 $CLUSTER $TRAIN --export="$LOGDIR/model.safetensors" 2>&1 |
  tee "$LOGDIR/worker0.log"
status=0
grep -q "test accuracy" "$LOGDIR/worker0.log" || status=1
# the chief stopped the ps; let the others finish
for p in $PIDS; do wait "$p" 2>/dev/null; done
PIDS=""
tail -n 2 "$LOGDIR/evaluator.log" | sed 's/^/demo: /'
if [ $status = 0 ]; then
  grep "training done" "$LOGDIR/worker0.log" | sed 's/^worker 0: /demo: final model: /'
  echo "demo: done. Model: $LOGDIR/model.safetensors; logs: $LOGDIR/"
else
  echo "demo: training did not finish; see the logs in $LOGDIR/" >&2
fi
exit $status
