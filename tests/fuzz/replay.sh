#!/bin/sh
# replay.sh CC BUILD XML_DIR MAKE HARNESS... - build the libFuzzer harnesses and
# run each once over every file of tests/fuzz/corpus/<harness>/ (no mutation,
# deterministic). Writes XML_DIR/fuzz-replay.xml, one JUnit test case per
# harness: failed on a crash, leak or sanitizer report, skipped (with the
# reason) when CC cannot build libFuzzer binaries. Exit 1 when any failed.
set -u
cc=$1 build=$2 xml_dir=$3 make=$4
shift 4
mkdir -p "$xml_dir" "$build"
xml="$xml_dir/fuzz-replay.xml"
log="$build/replay-build.log"
cases="" failed=0 skipped=0 n=0 skip_reason=""

esc() { sed -e 's/&/\&amp;/g' -e 's/</\&lt;/g' -e 's/>/\&gt;/g' -e 's/"/\&quot;/g' | tr -cd '\11\12\15\40-\176'; }

if ! command -v "$cc" >/dev/null 2>&1; then
  skip_reason="$cc not found (install clang-14 and libclang-rt-14-dev: make deps)"
elif ! echo 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n){(void)d;(void)n;return 0;}' \
     | "$cc" -x c -fsanitize=fuzzer,address,undefined -o "$build/probe" - >"$log" 2>&1; then
  skip_reason="$cc cannot link -fsanitize=fuzzer (libclang-rt-14-dev missing?): $(head -1 "$log")"
fi
if [ -z "$skip_reason" ] && ! $make -s -j2 fuzz-bins FUZZ_CC="$cc" FUZZ_BUILD="$build" >"$log" 2>&1; then
  echo "fuzz-replay: building the harnesses failed:"; tail -20 "$log"
  build_failed=1
else
  build_failed=0
fi

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
for h in "$@"; do
  n=$((n + 1))
  corpus=tests/fuzz/corpus/$h
  t0=$(date +%s.%N)
  if [ -n "$skip_reason" ]; then
    skipped=$((skipped + 1))
    body="<skipped message=\"$(printf '%s' "$skip_reason" | esc)\"/>"
    echo "fuzz-replay: $h skipped: $skip_reason"
  elif [ $build_failed = 1 ]; then
    failed=$((failed + 1))
    body="<failure message=\"build failed\">$(tail -30 "$log" | esc)</failure>"
  elif ! ls "$corpus"/* >/dev/null 2>&1; then
    failed=$((failed + 1))
    body="<failure message=\"empty corpus $corpus\"/>"
    echo "fuzz-replay: $h FAILED: no corpus in $corpus"
  elif "$build/bin/$h" -runs=0 -timeout=20 -rss_limit_mb=2048 "$corpus"/* >"$build/replay-$h.log" 2>&1; then
    files=$(ls "$corpus" | wc -l)
    body="<system-out>$files corpus files</system-out>"
    echo "fuzz-replay: $h ok ($files files)"
  else
    failed=$((failed + 1))
    body="<failure message=\"crash, leak or sanitizer report\">$(tail -40 "$build/replay-$h.log" | esc)</failure>"
    echo "fuzz-replay: $h FAILED (log $build/replay-$h.log)"; tail -30 "$build/replay-$h.log"
  fi
  secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.3f", b - a }')
  cases="$cases<testcase classname=\"fuzz-replay\" name=\"$h replays its corpus\" time=\"$secs\">$body</testcase>
"
done
{
  echo '<?xml version="1.0" encoding="UTF-8"?>'
  echo "<testsuites><testsuite name=\"fuzz-replay\" tests=\"$n\" failures=\"$failed\" skipped=\"$skipped\">"
  printf '%s' "$cases"
  echo "</testsuite></testsuites>"
} >"$xml"
[ $failed = 0 ]
