#!/bin/sh
# Run every test against the normal build (bin/) and the sanitizer build
# (build/asan/bin/), write JUnit XML into tests/out/, and end with one summary
# line counting every test. Exit status 1 when anything failed.
set -u
cd "$(dirname "$0")/.."
OUT=tests/out
rm -rf "$OUT"
mkdir -p "$OUT"
status=0
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

for build in normal asan; do
  if [ $build = normal ]; then dir=bin; else dir=build/asan/bin; fi
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
  echo "== system tests ($build build: $dir)"
  RESTPS_BIN_DIR=$dir pytest-3 -q -rs -p no:cacheprovider tests/system \
      --junitxml="$OUT/system-$build.xml" -o junit_suite_name="system-$build" || status=1
done

echo "== fuzz corpus replay (clang, ASan+UBSan: tests/fuzz/)"
${MAKE:-make} -s fuzz-replay FUZZ_XML_DIR="$OUT" || status=1

/usr/bin/python3 tests/summary.py "$OUT"/*.xml || status=1
exit $status
