#!/bin/sh
# bench/push.sh - `make bench`: a push against a pull of the same bytes, and
# two pushers at once against one (issue 20 section 2): one psd (async, sgd,
# --http_threads=2) on a free 127.0.0.1 port, bin/bench_push against it, the
# psd stopped by PID. Prints figures, ratios and PASS/BELOW per target; exits
# non-zero only when something broke, never for a figure.
# Environment: BIN_DIR (default bin), BENCH_PUSH_REPS (default 9),
# PSD_FLAGS (more psd flags), BENCH_ARGS (more bench_push flags, e.g. --verbose).
set -u
cd "$(dirname "$0")/.." || exit 1
BIN_DIR=${BIN_DIR:-bin}
for f in "$BIN_DIR/psd" "$BIN_DIR/bench_push"; do
  [ -x "$f" ] || { echo "bench: $f is missing (make all bench-bins)" >&2; exit 1; }
done
tmp=$(mktemp -d "${TMPDIR:-/tmp}/restps-push.XXXXXX") || exit 1
pid=""
cleanup() {
  if [ -n "$pid" ]; then
    kill -TERM "$pid" 2>/dev/null
    i=0
    while kill -0 "$pid" 2>/dev/null && [ "$i" -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# shellcheck disable=SC2086
"$BIN_DIR/psd" --port=0 --bind=127.0.0.1 --logdir= --http_threads=2 ${PSD_FLAGS:-} \
  >"$tmp/psd.out" 2>"$tmp/psd.err" &
pid=$!
i=0
while :; do
  line=$(head -n 1 "$tmp/psd.out" 2>/dev/null)
  case $line in "psd: listening on http://"*) break ;; esac
  if ! kill -0 "$pid" 2>/dev/null || [ $i -ge 100 ]; then
    echo "bench: psd did not start:" >&2
    cat "$tmp/psd.err" >&2
    exit 1
  fi
  i=$((i + 1))
  sleep 0.1
done
addr=${line#psd: listening on http://}
# shellcheck disable=SC2086
"$BIN_DIR/bench_push" --psd="$addr" --psd_pid="$pid" --reps="${BENCH_PUSH_REPS:-9}" ${BENCH_ARGS:-}
rc=$?
kill -0 "$pid" 2>/dev/null || { echo "bench: psd died during the bench" >&2; rc=1; }
if grep -qiE "error|fatal|sanitizer" "$tmp/psd.err"; then
  echo "bench: psd logged errors:" >&2
  grep -iE "error|fatal|sanitizer" "$tmp/psd.err" | head -5 >&2
  rc=1
fi
exit $rc
