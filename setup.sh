#!/usr/bin/env bash
# Set up gossipd on a fresh machine: a virtual environment in .venv with gossipd and what its
# tests need.  Safe to run again.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[test,plot]'
echo "gossipd is set up in .venv ($(.venv/bin/gossipd --help >/dev/null && echo ok))"
