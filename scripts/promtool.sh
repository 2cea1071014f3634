#!/bin/sh
# Fetch Prometheus's promtool for the /metrics test without installing the
# prometheus package (which would enable a server on port 9090): only the
# promtool binary goes into build/tools/ (scripts/debtool.sh).
# Quiet and idempotent; when it cannot (no apt), the test skips and says why.
set -u
cd "$(dirname "$0")/.."
[ -x build/tools/promtool ] && exit 0
command -v promtool >/dev/null 2>&1 && exit 0
command -v apt-get >/dev/null 2>&1 || exit 0
sh scripts/debtool.sh prometheus usr/bin/promtool || echo "promtool: the promtool check will be skipped" >&2
exit 0
