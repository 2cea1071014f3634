#!/bin/sh
# make coverage: line coverage of the C code (gcovr) under the full normal
# run and under the sanitizer run's subset, both on one --coverage build
# (CUDA=0, -O1, like the sanitizer build). The subset run reaches the build
# through a folder whose path names asan, so conftest.py and the tests' own
# ASan checks take it for the sanitizer run: the same skips
# (tests/support/sanitizer_subset.py and the tests' own) and the same shorter
# runs. Unit tests count in both. Prints both line sets' sizes and the ratio,
# writes the line sets to BUILD/coverage/ and the summary to
# tests/coverage.txt (which make test prints). Slow (two whole system runs
# side by side): not part of make test.
#   sh tests/coverage.sh [BUILD]   (default build/cov, made by make coverage)
set -u
cd "$(dirname "$0")/.."
COV=${1:-build/cov}
ABS=$(pwd)
GC=$ABS/$COV/gcda
OUT=$COV/coverage
WORKERS=${RESTPS_TEST_WORKERS:-3}
rm -rf "$GC" "$OUT"
mkdir -p "$GC/full" "$GC/subset" "$OUT"
ln -sfn bin "$COV/asan-subset-bin"
find "$COV" -name '*.gcda' -delete

xdist=""
/usr/bin/python3 -c 'import xdist' 2>/dev/null && xdist="-n $WORKERS --dist load"
echo "coverage: unit tests"
for t in "$COV"/bin/test_*; do
  [ -x "$t" ] || continue
  GCOV_PREFIX=$GC/full "$t" >/dev/null 2>&1 || echo "coverage: $t failed (its lines still count)"
  GCOV_PREFIX=$GC/subset "$t" >/dev/null 2>&1
done
echo "coverage: the full system run and the sanitizer subset, side by side (logs $OUT/system-*.log)"
GCOV_PREFIX=$GC/full RESTPS_BIN_DIR=$COV/bin pytest-3 -q -rs -p no:cacheprovider $xdist tests/system \
    >"$OUT/system-full.log" 2>&1 &
p1=$!
GCOV_PREFIX=$GC/subset RESTPS_BIN_DIR=$COV/asan-subset-bin pytest-3 -q -rs -p no:cacheprovider tests/system \
    >"$OUT/system-subset.log" 2>&1 &
p2=$!
wait $p1 || echo "coverage: some tests failed in the full run (their lines up to the failure count): $(tail -1 "$OUT/system-full.log")"
wait $p2 || echo "coverage: some tests failed in the subset run: $(tail -1 "$OUT/system-subset.log")"
echo "coverage: full run: $(tail -1 "$OUT/system-full.log")"
echo "coverage: subset run: $(tail -1 "$OUT/system-subset.log")"
/usr/bin/python3 tests/coverage.py "$COV" "$GC/full" "$GC/subset" "$OUT" >"$OUT/report.txt"
rc=$?
cat "$OUT/report.txt"
{
  echo "# make coverage (tests/coverage.sh): lines of C reached by the full normal run and by the"
  echo "# sanitizer run's subset (tests/support/sanitizer_subset.py), on a --coverage build"
  cat "$OUT/report.txt"
} >tests/coverage.txt
exit $rc
