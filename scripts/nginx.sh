#!/bin/sh
# Fetch nginx, the peer `make bench` measures psd against (bench/run.sh),
# without installing Debian's nginx package: installing it enables a web
# server on port 80 on a systemd machine. Download the package and take only
# the nginx binary into build/tools/ (bench/run.sh runs it with its own
# config, prefix and temp paths in a temp folder, never as a daemon).
# Quiet and idempotent; an nginx already on the machine is used as it is.
set -u
cd "$(dirname "$0")/.."
[ -x build/tools/nginx ] && exit 0
[ -x /usr/sbin/nginx ] && exit 0
command -v apt-get >/dev/null 2>&1 || { echo "nginx: no apt-get; set NGINX=/path/to/nginx for make bench" >&2; exit 0; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! (cd "$tmp" && apt-get download -qq nginx >/dev/null 2>&1); then
  apt-get update -qq >/dev/null 2>&1
  (cd "$tmp" && apt-get download -qq nginx >/dev/null 2>&1) || {
    echo "nginx: could not download Debian's nginx package; set NGINX=/path/to/nginx for make bench" >&2
    exit 0; }
fi
if dpkg -x "$tmp"/nginx_*.deb "$tmp/x" && mkdir -p build/tools &&
  cp "$tmp/x/usr/sbin/nginx" build/tools/nginx; then
  echo "nginx: build/tools/nginx ($(build/tools/nginx -v 2>&1))"
else
  echo "nginx: could not unpack Debian's nginx package; set NGINX=/path/to/nginx for make bench" >&2
fi
exit 0
