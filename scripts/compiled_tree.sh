#!/usr/bin/env bash
# A copy of this checkout with the request path compiled by mypyc, for measuring what
# compilation buys (bench/README, "The request path compiled with mypyc").  An experiment,
# not how gossipd is installed: the daemons run compiled only when started from that copy,
# e.g. paired against this tree by
#
#   scripts/compiled_tree.sh /tmp/compiled
#   cd /tmp/compiled && "$CHECKOUT/.venv/bin/python" scripts/door_paired.py \
#       --base-tree "$CHECKOUT" --rounds 3 --json      # CHECKOUT: this checkout's path
#
# The copy is a git worktree of HEAD (so this tree never holds .so files that would shadow
# its .py files).  Needs gcc, the Python headers, and mypy in .venv (pip install mypy).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:?usage: scripts/compiled_tree.sh DIR (a new directory)}"
# The modules a request passes through (gossipd/ passes mypy: .ci/run checks it).  Left out:
# engines/echo.py (an async generator: mypyc has none).  Tests that subclass or patch these
# classes fail against the copy (bench/README: 36 of 231).
MODULES=(
    gossipd/http/server.py gossipd/http/door.py gossipd/http/answers.py
    gossipd/http/turnwrites.py gossipd/http/openai_api.py gossipd/http/openai_answers.py
    gossipd/ingress/runner.py gossipd/ingress/intake.py
    gossipd/core/admission.py gossipd/core/lifecycle.py gossipd/core/forwarded.py
    gossipd/core/placer.py gossipd/core/ring.py gossipd/core/owner.py gossipd/core/breaker.py
    gossipd/fanout/forwarding.py gossipd/fanout/peerlinks.py gossipd/fanout/holding.py
    gossipd/looppeer.py gossipd/zmtp.py
    gossipd/core/forwarder.py gossipd/core/queueing.py gossipd/fanout/owner.py gossipd/peerlink.py
)
git worktree add --detach "$DEST" HEAD
cd "$DEST"
"$OLDPWD/.venv/bin/mypyc" --ignore-missing-imports "${MODULES[@]}" > mypyc.log 2>&1 || {
    echo "mypyc failed: see $DEST/mypyc.log" >&2
    exit 1
}
echo "compiled $(find gossipd -name '*.so' | wc -l) modules into $DEST (remove it with: git worktree remove --force $DEST)"
