#!/bin/sh
# Install the Node packages of the OpenAPI contract checks (tests/contract)
# from package-lock.json, exactly. Idempotent and quiet: runs `npm ci` only
# when node_modules is missing or older than package-lock.json.
set -eu
dir="$(cd "$(dirname "$0")/.." && pwd)/tests/contract"
stamp="$dir/node_modules/.package-lock.json" # written by every npm install/ci
if [ -f "$stamp" ] && ! [ "$dir/package-lock.json" -nt "$stamp" ]; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "npm-deps: npm is missing (scripts/deps.sh installs Debian's nodejs and npm)" >&2
  exit 1
fi
log=/tmp/restps-npm-deps.log
echo "npm-deps: npm ci in tests/contract"
if ! (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error) >"$log" 2>&1; then
  echo "npm-deps: npm ci failed, see $log" >&2
  tail -20 "$log" >&2
  exit 1
fi
