#!/bin/sh
# bench/load.sh - part of `make bench`: the step rate of 2 async workers
# training against one psd, without and then with wrk (Debian's) pulling
# /v1/params and /v1/status over 64 connections (bench/load.lua) for the
# whole run; wrk's request rate and errors; psd's RSS after a warm-up round
# and after the run. Every process is stopped by PID. Exits non-zero only when
# something broke (a process failed, a request failed), never for a figure.
# Environment: LOAD_STEPS (global steps per run, default 4000), LOAD_CONNS (64),
# RESTPS_BIN_DIR (where psd and workerd are, default bin).
set -u
cd "$(dirname "$0")/.." || exit 1
DATA=/usr/share/datasets/fashion-mnist
B=${RESTPS_BIN_DIR:-bin}
STEPS=${LOAD_STEPS:-4000}
CONNS=${LOAD_CONNS:-64}
for f in "$B/psd" "$B/workerd"; do
  [ -x "$f" ] || { echo "load: $f is missing (make all)" >&2; exit 1; }
done
command -v wrk >/dev/null || { echo "load: wrk is missing (make deps)" >&2; exit 1; }
[ -d "$DATA" ] || { echo "load: $DATA is missing (make deps)" >&2; exit 1; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/restps-load.XXXXXX") || exit 1
pids=""
stop_all() {
  for p in $pids; do kill -TERM "$p" 2>/dev/null; done
  for p in $pids; do wait "$p" 2>/dev/null; done
  pids=""
}
trap 'stop_all; rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM
fp() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
rss() { sed -n 's/^VmRSS:[[:space:]]*\([0-9]*\) kB/\1/p' "/proc/$1/status"; }
step() { curl -s --noproxy '*' "http://$1/v1/status" | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["global_step"])'; }
# the steps/s of a run: the sum of the workers' own figures
rate() { cat "$@" | sed -n 's/.*finished after .* \([0-9.]*\) steps\/s$/\1/p' | awk '{s += $1} END {printf "%.1f", s}'; }

# run NAME LOAD(0/1): one training run of 2 workers; prints the figures
run() {
  name=$1 load=$2
  P=$(fp)
  "$B/psd" --ps_hosts=127.0.0.1:$P --logdir= >"$tmp/$name.psd.out" 2>"$tmp/$name.psd.err" &
  psd=$!
  pids="$pids $psd"
  i=0
  until grep -q "listening" "$tmp/$name.psd.out" 2>/dev/null; do
    i=$((i + 1)); [ $i -lt 100 ] || { echo "load: psd did not start" >&2; cat "$tmp/$name.psd.err" >&2; exit 1; }
    sleep 0.1
  done
  hosts="127.0.0.1:$(fp),127.0.0.1:$(fp)"
  args="--ps_hosts=127.0.0.1:$P --worker_hosts=$hosts --data_dir=$DATA --sync=0 --hidden_units=100 --batch_size=100 --train_steps=$STEPS --log_every=0 --keep_ps"
  # shellcheck disable=SC2086
  "$B/workerd" --task_index=1 $args >"$tmp/$name.w1" 2>&1 &
  w1=$!
  # shellcheck disable=SC2086
  "$B/workerd" --task_index=0 $args >"$tmp/$name.w0" 2>&1 &
  w0=$!
  pids="$pids $w0 $w1"
  if [ "$load" = 1 ]; then
    until [ "$(step 127.0.0.1:$P 2>/dev/null || echo 0)" -ge 1 ] 2>/dev/null; do sleep 0.05; done
    wrk -t2 -c"$CONNS" -d1s -s bench/load.lua "http://127.0.0.1:$P/" >"$tmp/warm.txt" 2>&1
    rss0=$(rss $psd)
    # until the workers finish (wrk's -d is an upper bound; it is stopped then)
    wrk -t2 -c"$CONNS" -d600s -s bench/load.lua "http://127.0.0.1:$P/" >"$tmp/wrk.txt" 2>&1 &
    wrk=$!
  fi
  wait $w0; rc0=$?
  wait $w1; rc1=$?
  if [ "$load" = 1 ]; then
    kill -INT $wrk 2>/dev/null; wait $wrk
    sleep 0.2
    rss1=$(rss $psd)
  fi
  kill -TERM $psd; wait $psd
  pids=""
  if [ $rc0 != 0 ] || [ $rc1 != 0 ]; then
    echo "load: a worker failed:" >&2; tail -5 "$tmp/$name.w0" "$tmp/$name.w1" >&2; exit 1
  fi
  acc=$(sed -n 's/.*test accuracy \([0-9.]*\).*/\1/p' "$tmp/$name.w0" | tail -1)
  r=$(rate "$tmp/$name.w0" "$tmp/$name.w1")
  if [ "$load" = 1 ]; then
    reqs=$(sed -n 's/^ *\([0-9]*\) requests in \([0-9.]*\)s.*/\1/p' "$tmp/wrk.txt")
    secs=$(sed -n 's/^ *[0-9]* requests in \([0-9.]*\)s.*/\1/p' "$tmp/wrk.txt")
    non2xx=$(sed -n 's/.*Non-2xx or 3xx responses: \([0-9]*\).*/\1/p' "$tmp/wrk.txt")
    sock=$(sed -n 's/.*Socket errors: connect \([0-9]*\), read \([0-9]*\), write \([0-9]*\), timeout \([0-9]*\).*/\1 \2 \3 \4/p' "$tmp/wrk.txt" | awk '{print $1+$2+$3+$4}')
    echo "with wrk ($CONNS connections): $r steps/s, test accuracy $acc; wrk $reqs requests in ${secs}s" \
      "($(awk -v n="$reqs" -v s="$secs" 'BEGIN {printf "%.0f", n / s}')/s), ${non2xx:-0} non-2xx, ${sock:-0} socket errors;" \
      "psd RSS $rss0 KiB after a warm-up, $rss1 KiB after the run"
    if [ "${non2xx:-0}" != 0 ] || [ "${sock:-0}" != 0 ] || [ -z "$reqs" ]; then
      echo "load: requests failed:" >&2; cat "$tmp/wrk.txt" >&2; exit 1
    fi
  else
    echo "without load:              $r steps/s, test accuracy $acc"
  fi
}

echo "== load: 2 async workers, $STEPS global steps, 784-100-10 Adam, with and without wrk"
run quiet 0
run loaded 1
