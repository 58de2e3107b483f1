#!/usr/bin/env bash
# Both environments the tests need, built side by side: ./.venv (scripts/setup.sh) and
# ./.venv-serve (scripts/setup_serving.sh). Each pip spends most of its time on one thread
# unpacking and writing files, so the two together take little more than the longer one.
# Fails when either fails (their editable installs of this repository take turns: both
# write its egg-info).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh &
main=$!
bash scripts/setup_serving.sh &
serving=$!
status=0
wait "$main" || { status=$?; echo "scripts/setup.sh failed (exit $status)" >&2; }
wait "$serving" || { status=$?; echo "scripts/setup_serving.sh failed (exit $status)" >&2; }
exit "$status"
