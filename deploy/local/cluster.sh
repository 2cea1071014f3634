#!/bin/sh
# Start a whole restps cluster on this machine: N ps tasks, M workers (worker 0
# is the chief) and optionally an evaluator, each on a free port, every log in
# one folder. Waits for the chief to finish, then for the others; Ctrl-C (or
# SIGTERM to this script) stops everything it started, by PID. `make demo` uses it.
#
#   deploy/local/cluster.sh --ps 2 --workers 3 --sync -- --train_steps=2000
set -u

usage() {
  cat <<'EOF'
usage: deploy/local/cluster.sh [options] [-- workerd flags...]
Start a restps cluster on this machine: ps tasks, workers (worker 0 is the
chief) and optionally an evaluator, each on a free port, with every process's
log in one folder. The workerd flags after -- go to every worker and the
evaluator (e.g. --train_steps=2000 --hidden_units=256,128 --optimizer=adam).
The chief's lines are shown here and written to its log. The script ends when
the chief and then the others have finished; Ctrl-C stops everything.

Options:
  --ps N            number of ps tasks (default 1)
  --workers N       number of worker tasks (default 2)
  --sync            synchronous training (workerd --sync=1)
  --async           asynchronous training (workerd --sync=0), the default
  --evaluator       also start an evaluator (workerd --job_name=evaluator --eval_secs=5)
  --logdir DIR      folder for the logs (ps0.log, worker0.log, ..., evaluator.log),
                    the ps checkpoints (DIR/ps-N/) and a 'cluster' file naming
                    each process's PID and address (default logs/cluster-<date>)
  --bin DIR         folder holding psd and workerd (default $RESTPS_BIN_DIR or bin)
  --host ADDR       address every task listens on and is reached at (default 127.0.0.1)
  --psd_flag F      one more flag for every psd, e.g. --psd_flag --save_checkpoint_secs=10
                    (repeatable; no spaces inside a flag)
  --chief_flag F    one more flag for the chief only, e.g. --chief_flag --export=model.safetensors
                    (repeatable; no spaces inside a flag)
  --quiet           do not show the chief's lines here (they are still in its log)
  -h, --help        this text

Exit status: the chief's (0 when training finished), 130 when interrupted,
2 for bad options.
EOF
}

die() { echo "cluster: $*" >&2; echo "cluster: see deploy/local/cluster.sh --help" >&2; exit 2; }
is_count() { case "$1" in ''|*[!0-9]*) return 1;; *) [ "$1" -ge "$2" ];; esac; }

NPS=1 NWORKERS=2 SYNC=0 EVAL=0 QUIET=0
LOGDIR="" BINDIR="${RESTPS_BIN_DIR:-bin}" HOST=127.0.0.1 PSD_FLAGS="" CHIEF_FLAGS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --ps) [ $# -ge 2 ] || die "--ps needs a number"; NPS=$2; shift 2;;
    --ps=*) NPS=${1#*=}; shift;;
    --workers) [ $# -ge 2 ] || die "--workers needs a number"; NWORKERS=$2; shift 2;;
    --workers=*) NWORKERS=${1#*=}; shift;;
    --sync) SYNC=1; shift;;
    --async) SYNC=0; shift;;
    --evaluator) EVAL=1; shift;;
    --logdir) [ $# -ge 2 ] || die "--logdir needs a folder"; LOGDIR=$2; shift 2;;
    --logdir=*) LOGDIR=${1#*=}; shift;;
    --bin) [ $# -ge 2 ] || die "--bin needs a folder"; BINDIR=$2; shift 2;;
    --bin=*) BINDIR=${1#*=}; shift;;
    --host) [ $# -ge 2 ] || die "--host needs an address"; HOST=$2; shift 2;;
    --host=*) HOST=${1#*=}; shift;;
    --psd_flag) [ $# -ge 2 ] || die "--psd_flag needs a flag"; PSD_FLAGS="$PSD_FLAGS $2"; shift 2;;
    --psd_flag=*) PSD_FLAGS="$PSD_FLAGS ${1#*=}"; shift;;
    --chief_flag) [ $# -ge 2 ] || die "--chief_flag needs a flag"; CHIEF_FLAGS="$CHIEF_FLAGS $2"; shift 2;;
    --chief_flag=*) CHIEF_FLAGS="$CHIEF_FLAGS ${1#*=}"; shift;;
    --quiet) QUIET=1; shift;;
    -h|--help) usage; exit 0;;
    --) shift; break;;
    *) die "unknown option '$1'";;
  esac
done
is_count "$NPS" 1 || die "--ps must be a whole number >= 1, not '$NPS'"
is_count "$NWORKERS" 1 || die "--workers must be a whole number >= 1, not '$NWORKERS'"
for b in psd workerd; do
  [ -x "$BINDIR/$b" ] || die "$BINDIR/$b not found: run make first (or give --bin)"
done
[ -n "$LOGDIR" ] || LOGDIR=logs/cluster-$(date +%Y%m%d-%H%M%S)
mkdir -p "$LOGDIR" || die "cannot create $LOGDIR"

# Free ports: bind to port 0 and let the kernel choose.
PY=/usr/bin/python3; [ -x "$PY" ] || PY=python3
ports=$($PY -c '
import socket, sys
socks = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(); s.bind((sys.argv[1], 0)); socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$HOST" $((NPS + NWORKERS))) ||
  die "cannot find free ports on $HOST"
PS_HOSTS="" WORKER_HOSTS="" i=0
for p in $ports; do
  if [ $i -lt "$NPS" ]; then PS_HOSTS="$PS_HOSTS${PS_HOSTS:+,}$HOST:$p"
  else WORKER_HOSTS="$WORKER_HOSTS${WORKER_HOSTS:+,}$HOST:$p"; fi
  i=$((i + 1))
done
CLUSTER="--ps_hosts=$PS_HOSTS --worker_hosts=$WORKER_HOSTS"
MODE="--sync=$SYNC"

PIDS="" TAIL=""
: >"$LOGDIR/cluster"
started() { PIDS="$PIDS $2"; echo "$1 $2 $3" >>"$LOGDIR/cluster"; }
# alive: running, not a zombie waiting to be reaped (kill -0 succeeds on those)
is_alive() { s=$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null) && [ -n "$s" ] && [ "$s" != Z ]; }
alive_any() { for p in $PIDS; do is_alive "$p" && return 0; done; return 1; }
stop_all() {
  for p in $PIDS; do kill -TERM "$p" 2>/dev/null; done
  n=0  # workers finish their step and leave, psd saves a checkpoint: give them 30 s
  while alive_any && [ $n -lt 300 ]; do sleep 0.1; n=$((n + 1)); done
  for p in $PIDS; do is_alive "$p" && kill -KILL "$p" 2>/dev/null && echo "cluster: killed $p (did not stop in 30 s)" >&2; done
  for p in $PIDS $TAIL; do wait "$p" 2>/dev/null; done
  PIDS=""
}
trap 'trap - INT TERM EXIT; trap "" PIPE; echo; echo "cluster: stopping everything"; stop_all; exit 130' INT TERM
trap 'stop_all' EXIT

i=0
for hp in $(echo "$PS_HOSTS" | tr , ' '); do
  # shellcheck disable=SC2086
  "$BINDIR/psd" --job_name=ps --task_index=$i $CLUSTER --logdir="$LOGDIR" $PSD_FLAGS \
    >"$LOGDIR/ps$i.log" 2>&1 &
  started "ps$i" $! "http://$hp"
  i=$((i + 1))
done
i=1
while [ $i -lt "$NWORKERS" ]; do
  # shellcheck disable=SC2086
  "$BINDIR/workerd" --job_name=worker --task_index=$i $CLUSTER $MODE "$@" \
    >"$LOGDIR/worker$i.log" 2>&1 &
  started "worker$i" $! "-"
  i=$((i + 1))
done
if [ "$EVAL" = 1 ]; then
  # shellcheck disable=SC2086
  "$BINDIR/workerd" --job_name=evaluator --task_index=0 $CLUSTER $MODE --eval_secs=5 "$@" \
    >"$LOGDIR/evaluator.log" 2>&1 &
  started evaluator $! "-"
fi
# shellcheck disable=SC2086
"$BINDIR/workerd" --job_name=worker --task_index=0 $CLUSTER $MODE "$@" $CHIEF_FLAGS \
  >"$LOGDIR/worker0.log" 2>&1 &
CHIEF=$!
started worker0 $CHIEF "-"

URL="http://${PS_HOSTS%%,*}"
var=hid_w
for a in "$@"; do
  # workerd's flags, not this script's ([-]: a '-', so that these lines do
  # not read as options of this script to test_cluster_sh's --help check)
  case "$a" in
    [-]-hidden_units=*,*|[-]-model=mlp:*,*) var=hid0_w;;
    [-]-hidden_units=*|[-]-model=mlp:?*) var=hid_w;;
    [-]-model=*) var=sm_w;;  # every model ends in the logits layer sm_w sm_b
  esac
done
mode=async; [ "$SYNC" = 1 ] && mode=sync
cat <<MSG
cluster: $NPS ps, $NWORKERS workers (worker 0 is the chief)$([ "$EVAL" = 1 ] && echo ", an evaluator"), $mode; logs in $LOGDIR/
cluster: ps at $(echo "$PS_HOSTS" | sed 's/,/, /g'); workers at $(echo "$WORKER_HOSTS" | sed 's/,/, /g')
cluster: open $URL/ in a browser (the live page), or look with:
  curl $URL/v1/status
  curl $URL/metrics
  curl $URL/v1/vars
  curl '$URL/v1/vars/$var?format=json&count=10'
cluster: Ctrl-C stops everything
MSG

if [ "$QUIET" = 0 ]; then
  tail -n +1 -f --pid="$CHIEF" "$LOGDIR/worker0.log" &
  TAIL=$!
fi
wait "$CHIEF"
status=$?
[ -n "$TAIL" ] && wait "$TAIL" 2>/dev/null
# The chief stops the ps tasks when training is done (unless --keep_ps); the
# other workers end with it. Wait for them, then stop whatever is left.
n=0
while alive_any && [ $n -lt 600 ]; do sleep 0.1; n=$((n + 1)); done
if alive_any; then
  echo "cluster: still running 60 s after the chief ended, stopping:$(for p in $PIDS; do is_alive "$p" && grep " $p " "$LOGDIR/cluster" | cut -d' ' -f1; done | tr '\n' ' ')" >&2
fi
trap - INT TERM EXIT
stop_all
if [ $status = 0 ]; then
  echo "cluster: the chief finished; logs in $LOGDIR/"
else
  echo "cluster: the chief exited with status $status; see $LOGDIR/worker0.log" >&2
fi
exit $status
