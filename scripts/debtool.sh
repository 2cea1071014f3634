#!/bin/sh
# debtool.sh PACKAGE PATH: take one file, PATH inside Debian's PACKAGE (e.g.
# usr/bin/promtool), into build/tools/ without installing the package, which
# would enable its service (prometheus on port 9090, nginx on port 80):
# apt-get download (after one apt-get update when that fails), dpkg -x.
# Exit 0 with build/tools/<basename of PATH> in place, else 1 with one line
# on stderr saying why. Used by promtool.sh and nginx.sh.
set -u
cd "$(dirname "$0")/.."
pkg=$1
path=$2
name=$(basename "$path")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! (cd "$tmp" && apt-get download -qq "$pkg" >/dev/null 2>&1); then
  apt-get update -qq >/dev/null 2>&1
  (cd "$tmp" && apt-get download -qq "$pkg" >/dev/null 2>&1) || {
    echo "$name: could not download Debian's $pkg package" >&2
    exit 1; }
fi
dpkg -x "$tmp/${pkg}"_*.deb "$tmp/x" && mkdir -p build/tools && cp "$tmp/x/$path" "build/tools/$name" || {
  echo "$name: could not take $path out of Debian's $pkg package" >&2
  exit 1; }
echo "$name: build/tools/$name"
