#!/usr/bin/env bash
# Issue 21's robustness check: `bash .ci/run` on a fresh clone, N times in a
# row (default 2), with two CPU-bound busy loops running beside it the whole
# time (on a 2-vCPU machine: load average ~3). Not run by CI; run it by hand:
#
#   bash .ci/run-beside-hogs.sh [COMMIT (default HEAD)] [RUNS (default 2)]
#
# Each run's output goes to /tmp/run-beside-hogs-N.log, ending with its exit
# status, its seconds and the load average. Exit status: the failed runs.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
commit="$(git -C "$repo" rev-parse "${1:-HEAD}")"
runs="${2:-2}"
failed=0
for run in $(seq "$runs"); do
    log="/tmp/run-beside-hogs-$run.log"
    clone="$(mktemp -d)"
    git clone -q "$repo" "$clone" && git -C "$clone" checkout -q "$commit"
    python3 -c 'while True: pass' & hog1=$!
    python3 -c 'while True: pass' & hog2=$!
    start=$SECONDS
    echo "run $run of $commit, busy loops $hog1 $hog2, started $(date -u +%FT%TZ)" > "$log"
    (cd "$clone" && bash .ci/run) >> "$log" 2>&1
    status=$?
    kill "$hog1" "$hog2"
    echo "exit $status in $((SECONDS - start)) s; load average $(cut -d' ' -f1-3 /proc/loadavg)" >> "$log"
    tail -1 "$log"
    [ "$status" = 0 ] || failed=$((failed + 1))
    rm -rf "$clone"
done
exit "$failed"
