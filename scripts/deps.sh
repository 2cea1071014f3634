#!/bin/sh
# Install the Debian packages restps needs to build, test and benchmark.
# Idempotent and quiet: asks apt only for what is missing.
# chromium, chromium-driver, python3-selenium: the headless browser test
# (tests/system/test_browser.py). yamllint: deploy/k8s (tests/system/test_deploy_files.py).
# clang-14, libclang-rt-14-dev: the libFuzzer harnesses (tests/fuzz/, make fuzz).
# wrk: the load test and bench (tests/system/test_load.py, bench/load.sh);
# valgrind: tests/system/test_valgrind.py.
# python3-pytest-xdist: the system tests' parallel workers (tests/run.sh);
# gcovr: line coverage of the C code (make coverage).
# wamerican wngerman wfrench ... wpolish: the word lists of workerd --data=langid (/usr/share/dict).
# protobuf-c-compiler, libprotobuf-c-dev: workerd's ONNX export (client/onnx: protoc-c on onnx.proto).
# python3-torch (Debian's CPU build, ~160 packages, ~50 MB to download): the PyTorch worker
# beside C workers (client/python/examples/torch_worker.py, tests/system/test_torch_worker.py),
# and make bench's peer (bench/train.sh, bench/cnn_compare.py).
# Arguments name more packages (make bench passes its own).
# nginx (make bench's peer) is not installed, which would enable a server on
# port 80: scripts/nginx.sh takes its binary from Debian's package.
set -eu
PKGS="gcc make pkg-config ca-certificates curl openssl \
libmicrohttpd-dev libgnutls28-dev libcurl4-openssl-dev libjansson-dev libopenblas-dev zlib1g-dev \
libcmocka-dev python3 python3-venv python3-pytest python3-numpy python3-yaml python3-crcmod gnuplot-nox \
dataset-fashion-mnist yamllint \
chromium chromium-driver python3-selenium \
clang-14 libclang-rt-14-dev \
wrk valgrind \
python3-pytest-xdist gcovr protobuf-c-compiler libprotobuf-c-dev python3-torch \
wamerican wngerman wfrench wspanish witalian wdutch wportuguese wswedish wnorwegian wdanish wpolish $*"
missing=""
for p in $PKGS; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing="$missing $p"
  fi
done
if [ -z "$missing" ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO=sudo; else
    echo "deps: missing packages:$missing (run as root or install them)" >&2; exit 1
  fi
fi
echo "deps: installing$missing"
export DEBIAN_FRONTEND=noninteractive
# apt-get update only when the package lists are empty or an install fails
if ! $SUDO apt-get install -y -qq --no-install-recommends $missing >/tmp/restps-deps.log 2>&1; then
  $SUDO apt-get update -qq >>/tmp/restps-deps.log 2>&1
  $SUDO apt-get install -y -qq --no-install-recommends $missing >>/tmp/restps-deps.log 2>&1 || {
    echo "deps: apt-get install failed, see /tmp/restps-deps.log" >&2; tail -20 /tmp/restps-deps.log >&2; exit 1; }
fi
