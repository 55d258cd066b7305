#!/usr/bin/env bash
# Paired benchmarks: a BASE tree (default .base13: a copy of 9d76c84, the commit before the
# redesign) against this tree, alternating route and ingress (the order of the two trees
# swaps every round), then the CURVE ratios of this tree.  One JSON line per run in
# $OUT/paired.jsonl, the CURVE reports in $OUT/*_curve.json.
#   here:            BASE_TREE=/tmp/base-13 PYTHON=.venv/bin/python ROUNDS=5 scripts/bench_paired.sh
#   on a lent GPU machine (no network, no pyzmq): the pyzmq and msgspec wheels in .whl first.
set -u
PYTHON=${PYTHON:-python3}
SITE=""
if [ -d .whl ] && ! "$PYTHON" -c "import zmq, msgspec" 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    SITE=":/tmp/site"
fi
case $PYTHON in */*) PYTHON=$(realpath -s "$PYTHON") ;; esac
HEAD_TREE=$PWD
BASE_TREE=${BASE_TREE:-$PWD/.base13}
ROUNDS=${ROUNDS:-3}
BENCH_ARGS=${BENCH_ARGS:---repeats 3}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
bench() {  # tree, then bench arguments
    local tree=$1; shift
    (cd "$tree" && PYTHONPATH="$tree$SITE" timeout 300 "$PYTHON" -m gossipd bench "$@" --json \
        2>>"$OUT/stderr.log")
}
PYTHONPATH="$HEAD_TREE$SITE" "$PYTHON" -c "import gossipd.daemon, simulations.cluster" || exit 1
nproc; "$PYTHON" --version
for i in $(seq "$ROUNDS"); do
    order="base head"; [ $((i % 2)) = 0 ] && order="head base"
    for tree in $order; do
        dir=$BASE_TREE; [ $tree = head ] && dir=$HEAD_TREE
        for what in route ingress; do
            report=$(bench "$dir" $what $BENCH_ARGS)
            echo "{\"tree\": \"$tree\", \"what\": \"$what\", \"round\": $i, \"load\": \"$(cut -d' ' -f1 /proc/loadavg)\", \"report\": ${report:-null}}" \
                | tee -a "$OUT/paired.jsonl"
        done
    done
done
[ "${CURVE:-1}" = 0 ] && exit 0
bench "$HEAD_TREE" ingress --curve --repeats 5 > "$OUT/ingress_curve.json"; cat "$OUT/ingress_curve.json"
bench "$HEAD_TREE" route --curve --repeats 5 > "$OUT/route_curve.json"; cat "$OUT/route_curve.json"
