#!/bin/sh
# bench/run.sh - `make bench`: two psd (--http_threads=2 and =1) and nginx on free
# 127.0.0.1 ports, bin/bench_pull between them, every process stopped by PID.
# Prints figures, ratios and PASS/BELOW per target; exits non-zero only when
# something broke (a server did not start, a request failed), never for a figure.
# Environment: BENCH_REPS (default 15), BENCH_SCALE (batch sizes, default 1),
# BENCH_ARGS (more bench_pull flags, e.g. --verbose for every repetition's figure),
# PSD_FLAGS (more flags for both psd, e.g. --buffer_pool_mib=0),
# NGINX (default build/tools/nginx, which scripts/nginx.sh fetches, else /usr/sbin/nginx). OPENBLAS_CORETYPE is left as found.
set -u
cd "$(dirname "$0")/.." || exit 1

if [ -z "${NGINX:-}" ]; then
  NGINX=/usr/sbin/nginx
  [ -x build/tools/nginx ] && NGINX=build/tools/nginx
fi
REPS=${BENCH_REPS:-15}
SCALE=${BENCH_SCALE:-1}
for f in bin/psd bin/bench_pull "$NGINX"; do
  [ -x "$f" ] || { echo "bench: $f is missing (make all bench-bins; sh scripts/nginx.sh)" >&2; exit 1; }
done

tmp=$(mktemp -d "${TMPDIR:-/tmp}/restps-bench.XXXXXX") || exit 1
chmod 755 "$tmp"   # nginx workers may run as another user
pids=""

stop_all() {
  for p in $pids; do kill -TERM "$p" 2>/dev/null; done
  for p in $pids; do
    i=0
    while kill -0 "$p" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
    if kill -0 "$p" 2>/dev/null; then
      echo "bench: PID $p did not stop on SIGTERM, killing it" >&2
      kill -KILL "$p" 2>/dev/null
    fi
    wait "$p" 2>/dev/null
  done
  pids=""
}
cleanup() { stop_all; rm -rf "$tmp"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

# start_psd NAME FLAGS...: sets addr and pid.
start_psd() {
  name=$1
  shift
  # shellcheck disable=SC2086
  bin/psd --port=0 --bind=127.0.0.1 --logdir= "$@" ${PSD_FLAGS:-} >"$tmp/$name.out" 2>"$tmp/$name.err" &
  pid=$!
  pids="$pids $pid"
  i=0
  while :; do
    line=$(head -n 1 "$tmp/$name.out" 2>/dev/null)
    case $line in "psd: listening on http://"*) break ;; esac
    if ! kill -0 "$pid" 2>/dev/null || [ $i -ge 100 ]; then
      echo "bench: psd $* did not start:" >&2
      cat "$tmp/$name.err" >&2
      exit 1
    fi
    i=$((i + 1))
    sleep 0.1
  done
  addr=${line#psd: listening on http://}
}

start_psd psd2 --http_threads=2
psd2_addr=$addr psd2_pid=$pid
start_psd psd0 --http_threads=1
psd0_addr=$addr psd0_pid=$pid

# nginx: its own config and files in $tmp, not a daemon, on a free port
# (a random one; another is tried if that one is taken).
mkdir -p "$tmp/www"
chmod 755 "$tmp/www"
ngx_pid=""
for try in 1 2 3 4 5 6 7 8; do
  port=$(($(od -An -N2 -tu2 /dev/urandom | tr -d ' ') % 30000 + 20000))
  ss -ltnH "sport = :$port" 2>/dev/null | grep -q . && continue
  cat >"$tmp/nginx.conf" <<EOF
daemon off;
worker_processes auto;
pid $tmp/nginx.pid;
error_log $tmp/nginx-error.log warn;
events { worker_connections 256; }
http {
    access_log $tmp/nginx-access.log;
    client_body_temp_path $tmp/ngx-body;
    proxy_temp_path $tmp/ngx-proxy;
    fastcgi_temp_path $tmp/ngx-fastcgi;
    uwsgi_temp_path $tmp/ngx-uwsgi;
    scgi_temp_path $tmp/ngx-scgi;
    types { }
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    tcp_nodelay on;
    keepalive_timeout 120s;
    keepalive_requests 1000000;
    open_file_cache max=16 inactive=120s;
    server {
        listen 127.0.0.1:$port;
        root $tmp/www;
    }
}
EOF
  rm -f "$tmp/nginx.pid"
  "$NGINX" -p "$tmp" -c "$tmp/nginx.conf" -e "$tmp/nginx-error.log" \
    >"$tmp/nginx.out" 2>&1 &
  ngx_pid=$!
  i=0
  # the pid file appears once the listening socket is open
  while [ ! -s "$tmp/nginx.pid" ] && kill -0 "$ngx_pid" 2>/dev/null && [ $i -lt 100 ]; do
    sleep 0.1
    i=$((i + 1))
  done
  if [ -s "$tmp/nginx.pid" ] && kill -0 "$ngx_pid" 2>/dev/null; then
    pids="$pids $ngx_pid"
    break
  fi
  kill -TERM "$ngx_pid" 2>/dev/null
  wait "$ngx_pid" 2>/dev/null
  if ! grep -q "Address already in use" "$tmp/nginx-error.log" "$tmp/nginx.out" 2>/dev/null; then
    echo "bench: nginx did not start:" >&2
    cat "$tmp/nginx-error.log" "$tmp/nginx.out" >&2 2>/dev/null
    exit 1
  fi
  ngx_pid=""
done
[ -n "$ngx_pid" ] || { echo "bench: no free port for nginx after 8 tries" >&2; exit 1; }

echo "bench: psd (epoll x2) $psd2_addr pid $psd2_pid, psd (epoll x1) $psd0_addr pid $psd0_pid," \
  "nginx 127.0.0.1:$port pid $ngx_pid; $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')"
# In the background and waited for, so that a signal stops it (and everything) at once.
# shellcheck disable=SC2086
bin/bench_pull --psd="$psd2_addr" --psd_pid="$psd2_pid" --psd0="$psd0_addr" \
  --psd0_pid="$psd0_pid" --nginx="127.0.0.1:$port" --docroot="$tmp/www" \
  --reps="$REPS" --scale="$SCALE" ${BENCH_ARGS:-} &
bench_pid=$!
pids="$bench_pid $pids"
wait "$bench_pid"
rc=$?
pids=${pids#"$bench_pid "}
for p in $psd2_pid $psd0_pid $ngx_pid; do
  kill -0 "$p" 2>/dev/null || { echo "bench: server PID $p died during the bench" >&2; rc=1; }
done
stop_all
for s in psd2 psd0; do
  if grep -qiE "error|fatal|sanitizer" "$tmp/$s.err"; then
    echo "bench: $s logged errors:" >&2
    grep -iE "error|fatal|sanitizer" "$tmp/$s.err" | head -5 >&2
    rc=1
  fi
done
# the step rate beside many pulling clients (wrk), and its errors
sh bench/load.sh || rc=1
exit $rc
