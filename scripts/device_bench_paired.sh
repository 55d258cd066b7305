#!/usr/bin/env bash
# Paired benchmarks on a quiet many-core machine (the lent GPU machine's 16 cores): a BASE
# tree (default .base13: the commit before the redesign) against this tree, alternating
# route and ingress, then the CURVE ratios of this tree.  One JSON line per run in
# $OUT/paired.jsonl, the CURVE reports in $OUT/*_curve.json.
# Needs pyzmq and msgspec wheels in .whl (the machine has no network).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
HEAD_TREE=$PWD
BASE_TREE=${BASE_TREE:-$PWD/.base13}
ROUNDS=${ROUNDS:-3}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
bench() {  # tree, then bench arguments
    local tree=$1; shift
    (cd "$tree" && PYTHONPATH="$tree:/tmp/site" timeout 240 python3 -m gossipd bench "$@" --json \
        2>>"$OUT/stderr.log")
}
PYTHONPATH="$HEAD_TREE:/tmp/site" python3 -c "import gossipd.daemon, simulations.cluster" || exit 1
nproc; python3 --version
for i in $(seq "$ROUNDS"); do
    for tree in base head; do
        dir=$BASE_TREE; [ $tree = head ] && dir=$HEAD_TREE
        for what in route ingress; do
            report=$(bench "$dir" $what --repeats 3)
            echo "{\"tree\": \"$tree\", \"what\": \"$what\", \"round\": $i, \"report\": ${report:-null}}" \
                | tee -a "$OUT/paired.jsonl"
        done
    done
done
bench "$HEAD_TREE" ingress --curve --repeats 5 > "$OUT/ingress_curve.json"; cat "$OUT/ingress_curve.json"
bench "$HEAD_TREE" route --curve --repeats 5 > "$OUT/route_curve.json"; cat "$OUT/route_curve.json"
