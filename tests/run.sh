#!/bin/sh
# Run every test against the normal build (bin/) and the sanitizer build
# (build/asan/bin/), write JUnit XML into tests/out/, and end with one summary
# line counting every test. Exit status 1 when anything failed.
#
# The sanitizer build runs the unit tests and the system tests that reach C
# code; what it leaves to the normal build (file, spec and Python-only
# checks, timing and throughput tests) is listed with its reason in
# tests/support/sanitizer_subset.py and reported there as skipped. The two
# system runs go side by side, the normal one over pytest-xdist workers when
# python3-pytest-xdist is installed (tests start their processes on free
# ports in their own folders). tests/coverage.txt (make coverage) says how
# much of the C code the full run reaches that the sanitizer run reaches too.
#
# Environment: RESTPS_NORMAL_BIN, RESTPS_ASAN_BIN (the two builds' bin
# folders), RESTPS_TEST_OUT (tests/out), RESTPS_TEST_WORKERS (xdist workers
# for the normal build's system tests; default 2, 0 = no xdist),
# RESTPS_ASAN_WORKERS (xdist workers for the sanitizer build's; default 1:
# 2 took its lane from 720 to ~400 s, but its timing-bound tests failed
# twice in four runs beside the normal lane), RESTPS_SYSTEM_TESTS (tests/system, or
# some of its files).
set -u
cd "$(dirname "$0")/.."
NORMAL_BIN=${RESTPS_NORMAL_BIN:-bin}
ASAN_BIN=${RESTPS_ASAN_BIN:-build/asan/bin}
OUT=${RESTPS_TEST_OUT:-tests/out}
WORKERS=${RESTPS_TEST_WORKERS:-2}
ASAN_WORKERS=${RESTPS_ASAN_WORKERS:-1}
SYSTEM_TESTS=${RESTPS_SYSTEM_TESTS:-tests/system}
rm -rf "$OUT"
mkdir -p "$OUT"
status=0
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
t_start=$(date +%s)

if ! /usr/bin/python3 -c 'import xdist' 2>/dev/null; then
  echo "run.sh: python3-pytest-xdist is not installed (make deps): the system tests run one at a time"
  WORKERS=0
  ASAN_WORKERS=0
fi
xdist_args() { if [ "$1" -gt 1 ]; then echo "-n $1 --dist load"; fi; }

for build in normal asan; do
  if [ $build = normal ]; then dir=$NORMAL_BIN; else dir=$ASAN_BIN; fi
  echo "== unit tests ($build build: $dir)"
  for t in "$dir"/test_*; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    if ! CMOCKA_MESSAGE_OUTPUT=xml CMOCKA_XML_FILE="$OUT/unit-$build-$name.xml" "$t" >"$OUT/unit-$build-$name.log" 2>&1; then
      echo "FAILED: $t (log: $OUT/unit-$build-$name.log)"; tail -20 "$OUT/unit-$build-$name.log"
      status=1
    fi
    [ -s "$OUT/unit-$build-$name.xml" ] || { echo "FAILED: $t wrote no results (crashed?)"; status=1; }
  done
done
t_unit=$(date +%s)

# The two system runs side by side; each one's output goes to its log, shown
# when both are done.
system_run() { # build dir workers
  RESTPS_BIN_DIR=$2 pytest-3 -q -rs -p no:cacheprovider $(xdist_args "$3") $SYSTEM_TESTS \
      --junitxml="$OUT/system-$1.xml" -o junit_suite_name="system-$1" >"$OUT/system-$1.log" 2>&1
  echo $? >"$OUT/system-$1.rc"
  echo "$(date +%s)" >"$OUT/system-$1.end"
  times >"$OUT/system-$1.cpu" # the second line: the tests' processes, user and system CPU
}
echo "== system tests, side by side: normal build ($NORMAL_BIN, $WORKERS xdist workers), sanitizer build ($ASAN_BIN, its subset); logs $OUT/system-{normal,asan}.log"
system_run normal "$NORMAL_BIN" "$WORKERS" &
pid_normal=$!
system_run asan "$ASAN_BIN" "$ASAN_WORKERS" &
pid_asan=$!
wait $pid_normal
wait $pid_asan
for build in normal asan; do
  echo "== system tests ($build build), $(($(cat "$OUT/system-$build.end") - t_unit)) s, CPU $(sed -n 2p "$OUT/system-$build.cpu")"
  # the per-test progress dots are in the log; here the summary and what failed
  sed -n '/= FAILURES =\|= ERRORS =\|short test summary info/,$p' "$OUT/system-$build.log" | tail -150 \
    | grep . || tail -1 "$OUT/system-$build.log"
  [ "$(cat "$OUT/system-$build.rc")" = 0 ] || status=1
done
t_system=$(date +%s)

echo "== fuzz corpus replay (clang, ASan+UBSan: tests/fuzz/)"
${MAKE:-make} -s fuzz-replay FUZZ_XML_DIR="$OUT" || status=1
t_fuzz=$(date +%s)

echo "== time: unit tests $((t_unit - t_start)) s, system tests $((t_system - t_unit)) s (side by side), fuzz replay $((t_fuzz - t_system)) s"
[ -f tests/coverage.txt ] && sed -n 's/^summary: /== sanitizer coverage (make coverage, tests\/coverage.txt): /p' tests/coverage.txt
/usr/bin/python3 tests/summary.py "$OUT"/*.xml || status=1
exit $status
