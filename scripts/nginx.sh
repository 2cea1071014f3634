#!/bin/sh
# Fetch nginx, the peer `make bench` measures psd against (bench/run.sh),
# without installing Debian's nginx package: installing it enables a web
# server on port 80 on a systemd machine. Only the nginx binary goes into
# build/tools/ (scripts/debtool.sh); bench/run.sh runs it with its own config,
# prefix and temp paths in a temp folder, never as a daemon.
# Quiet and idempotent; an nginx already on the machine is used as it is.
set -u
cd "$(dirname "$0")/.."
[ -x build/tools/nginx ] && exit 0
[ -x /usr/sbin/nginx ] && exit 0
command -v apt-get >/dev/null 2>&1 || { echo "nginx: no apt-get; set NGINX=/path/to/nginx for make bench" >&2; exit 0; }
sh scripts/debtool.sh nginx usr/sbin/nginx || echo "nginx: set NGINX=/path/to/nginx for make bench" >&2
exit 0
