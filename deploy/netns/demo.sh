#!/bin/sh
# make hosts-demo: a small sync job on three hosts of one machine (a ps and
# two workers, each its own network namespace, address and 1 Gbit/s NIC; see
# hosts.sh), read with curl from another host while it trains, worker 1's
# cable pulled for a while and plugged back in; everything is removed at the
# end, also on a failure or Ctrl-C. Needs root (network namespaces).
# Environment: RESTPS_BIN_DIR (bin), STEPS (3000), RATE (1gbit).
set -eu
cd "$(dirname "$0")/../.."
BIN=${RESTPS_BIN_DIR:-bin}
STEPS=${STEPS:-3000}
RATE=${RATE:-1gbit}
H="deploy/netns/hosts.sh --name=restpsdemo"
[ "$(id -u)" = 0 ] || { echo "hosts-demo: network namespaces need root; run it as root" >&2; exit 1; }
out=$(mktemp -d /tmp/restps-hosts-demo.XXXXXX)
pids=""
cleanup() {
  for p in $pids; do kill "$p" 2>/dev/null || true; done
  $H down
}
trap cleanup EXIT
trap 'exit 130' INT TERM

$H up 3 --rate="$RATE"
ps=$($H addr host0):2222
workers=$($H addr host1):2222,$($H addr host2):2222
cluster="--ps_hosts=$ps --worker_hosts=$workers"
echo "hosts-demo: ps on host0 ($ps), workers on host1 and host2 ($workers); logs in $out"
# shellcheck disable=SC2086
$H exec host0 "$BIN/psd" --job_name=ps --task_index=0 $cluster --worker_lease_secs=3 \
  --logdir="$out/ps" >"$out/ps.log" 2>&1 &
pids="$pids $!"
# shellcheck disable=SC2086
$H exec host2 "$BIN/workerd" --job_name=worker --task_index=1 $cluster --sync=1 --train_steps="$STEPS" \
  --log_every=500 --step_delay_ms=5 >"$out/worker1.log" 2>&1 &
w1=$!
pids="$pids $w1"
# shellcheck disable=SC2086
$H exec host1 "$BIN/workerd" --job_name=worker --task_index=0 $cluster --sync=1 --train_steps="$STEPS" \
  --log_every=500 --step_delay_ms=5 --export="$out/model.safetensors" >"$out/worker0.log" 2>&1 &
w0=$!
pids="$pids $w0"

status() { $H exec host2 curl -s --max-time 3 "http://$ps/v1/sync" || echo "(no answer)"; echo; }
sleep 5
echo "--- from host2: curl http://$ps/v1/sync"
status
echo "--- worker 1's cable pulled (hosts.sh cut host2) for 8 s: after its 3 s lease the step goes on without it"
$H cut host2
sleep 6
echo "--- from host1: curl http://$ps/v1/sync"
$H exec host1 curl -s --max-time 3 "http://$ps/v1/sync"; echo
sleep 2
$H restore host2
echo "--- plugged back in (hosts.sh restore host2): worker 1 rejoins"
sleep 4
status
wait "$w0" || { echo "hosts-demo: the chief failed:" >&2; tail -20 "$out/worker0.log" >&2; exit 1; }
wait "$w1" || { echo "hosts-demo: worker 1 failed:" >&2; tail -20 "$out/worker1.log" >&2; exit 1; }
echo "--- the chief (host1):"
tail -3 "$out/worker0.log"
echo "hosts-demo: done; the model is $out/model.safetensors, the logs are in $out; the hosts are removed"
