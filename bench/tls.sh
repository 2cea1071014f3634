#!/bin/sh
# bench/tls.sh - `make bench`: HTTPS against plain HTTP for one training step's
# traffic (bin/bench_pushpull: a bulk push of gradients, then a bulk pull of the
# parameters) to one psd on 127.0.0.1, for models of 1, 16 and 64 MiB. Both
# psd run the same build and flags; the HTTPS one has --tls_cert/--tls_key from
# a CA this script makes with openssl. Prints a table and the HTTPS/HTTP ratio of
# throughput per size, and writes it to bench/out/tls.md. Exit non-zero only
# when something broke. Environment: BENCH_TLS_MIB (sizes, default "1 16 64"),
# BENCH_TLS_REPS (default 9), RESTPS_BIN_DIR (where psd and bench_pushpull
# are, default bin; relative to the repository root), BENCH_TLS_OUT (the
# table's file, default bench/out/tls.md). OPENBLAS_CORETYPE plays no
# part here.
set -u
cd "$(dirname "$0")/.." || exit 1
SIZES=${BENCH_TLS_MIB:-1 16 64}
REPS=${BENCH_TLS_REPS:-9}
BIN_DIR=${RESTPS_BIN_DIR:-bin}
OUT=${BENCH_TLS_OUT:-bench/out/tls.md}
for f in "$BIN_DIR/psd" "$BIN_DIR/bench_pushpull"; do
  [ -x "$f" ] || { echo "bench-tls: $f is missing (make all bench-bins)" >&2; exit 1; }
done
command -v openssl >/dev/null || { echo "bench-tls: openssl is missing (make deps)" >&2; exit 1; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/restps-tls.XXXXXX") || exit 1
pids=""
cleanup() {
  for p in $pids; do kill -TERM "$p" 2>/dev/null; done
  for p in $pids; do wait "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ossl() { openssl "$@" >>"$tmp/openssl.log" 2>&1 || { echo "bench-tls: openssl $1 failed:" >&2; cat "$tmp/openssl.log" >&2; exit 1; }; }
ossl req -x509 -newkey rsa:2048 -nodes -keyout "$tmp/ca.key" -out "$tmp/ca.pem" -days 2 -subj "/CN=restps bench CA"
ossl req -newkey rsa:2048 -nodes -keyout "$tmp/srv.key" -out "$tmp/srv.csr" -subj "/CN=127.0.0.1"
echo "subjectAltName=IP:127.0.0.1" >"$tmp/ext.cnf"
ossl x509 -req -in "$tmp/srv.csr" -CA "$tmp/ca.pem" -CAkey "$tmp/ca.key" -CAcreateserial \
  -out "$tmp/srv.pem" -days 2 -extfile "$tmp/ext.cnf"

# start NAME FLAGS...: a psd on a free port; sets addr
start() {
  name=$1; shift
  "$BIN_DIR/psd" --port=0 --bind=127.0.0.1 --logdir= "$@" >"$tmp/$name.out" 2>"$tmp/$name.err" &
  pids="$pids $!"
  i=0
  until line=$(head -n 1 "$tmp/$name.out" 2>/dev/null) && [ -n "$line" ]; do
    i=$((i + 1))
    [ $i -lt 100 ] || { echo "bench-tls: psd $name did not start:" >&2; cat "$tmp/$name.err" >&2; exit 1; }
    sleep 0.1
  done
  addr=${line#psd: listening on http*://}
}
start http
http_addr=$addr
start https --tls_cert="$tmp/srv.pem" --tls_key="$tmp/srv.key"
https_addr=$addr

mkdir -p "$(dirname "$OUT")" || exit 1
{
  echo "# HTTPS against HTTP: one step's push + pull to one psd on loopback"
  echo
  echo "libcurl $(curl --version | head -n 1 | cut -d' ' -f2) with $(curl --version | head -n 1 | grep -o 'OpenSSL/[^ ]*\|GnuTLS/[^ ]*' | head -n 1) on the worker side, libmicrohttpd with GnuTLS in psd; median of $REPS steps after a warm-up; $(nproc) cores."
  echo
  echo "| model MiB | HTTP push ms | HTTP pull ms | HTTP GB/s | HTTPS push ms | HTTPS pull ms | HTTPS GB/s | HTTPS/HTTP |"
  echo "|---|---|---|---|---|---|---|---|"
} >"$tmp/tls.md"
cat "$tmp/tls.md"
for mib in $SIZES; do
  h=$("$BIN_DIR/bench_pushpull" --hosts="$http_addr" --mib="$mib" --reps="$REPS") ||
    { echo "bench-tls: HTTP run of $mib MiB failed" >&2; exit 1; }
  s=$("$BIN_DIR/bench_pushpull" --hosts="$https_addr" --mib="$mib" --reps="$REPS" --ca="$tmp/ca.pem") ||
    { echo "bench-tls: HTTPS run of $mib MiB failed" >&2; exit 1; }
  # fields: ps_tasks MiB push_ms pull_ms GB/s
  row=$(echo "$h $s" | awk '{ printf "| %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |", $2, $3, $4, $5, $8, $9, $10, ($5 > 0 ? $10 / $5 : 0) }')
  echo "$row"
  echo "$row" >>"$tmp/tls.md"
done
cp "$tmp/tls.md" "$OUT" || exit 1
echo "bench-tls: written to $OUT"
