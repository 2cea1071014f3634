#!/bin/sh
# Install the PyPI packages of the test suite (tests/support/requirements.txt:
# pinned versions, each with its hashes) into build/venv, an environment of its
# own made with Debian's python3 (python3-venv, from scripts/deps.sh).
# Idempotent and quiet: does nothing when build/venv already holds exactly
# this lock. usage: pydeps.sh [LOCK VENV] (make bench: its own lock and venv)
set -eu
cd "$(dirname "$0")/.."
lock=${1:-tests/support/requirements.txt}
venv=${2:-build/venv}
stamp="$venv/.restps-lock"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && cmp -s "$lock" "$stamp"; then
  exit 0
fi
log=/tmp/restps-pydeps.log
echo "pydeps: installing $lock into $venv (PyPI)"
rm -rf "$venv"
if ! { /usr/bin/python3 -m venv "$venv" &&
       "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-input \
           --require-hashes --no-deps --only-binary=:all: -r "$lock"; } >"$log" 2>&1; then
  echo "pydeps: pip install failed, see $log" >&2
  tail -20 "$log" >&2
  rm -rf "$venv"
  exit 1
fi
cp "$lock" "$stamp"
