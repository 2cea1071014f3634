#!/bin/sh
# Fetch Prometheus's promtool for the /metrics test without installing the
# prometheus package (which would enable a server on port 9090): download the
# Debian package and take only the promtool binary into build/tools/.
# Quiet and idempotent; when it cannot (no apt), the test skips and says why.
set -u
cd "$(dirname "$0")/.."
[ -x build/tools/promtool ] && exit 0
command -v promtool >/dev/null 2>&1 && exit 0
command -v apt-get >/dev/null 2>&1 || exit 0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! (cd "$tmp" && apt-get download -qq prometheus >/dev/null 2>&1); then
  apt-get update -qq >/dev/null 2>&1
  (cd "$tmp" && apt-get download -qq prometheus >/dev/null 2>&1) || {
    echo "promtool: could not download Debian's prometheus package; the promtool check will be skipped" >&2
    exit 0; }
fi
dpkg -x "$tmp"/prometheus_*.deb "$tmp/x" && mkdir -p build/tools &&
  cp "$tmp/x/usr/bin/promtool" build/tools/promtool && echo "promtool: build/tools/promtool"
