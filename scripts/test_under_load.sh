#!/usr/bin/env bash
# Proof that the suite is deterministic on a loaded machine: clone the current commit afresh, keep every
# core busy with a CPU burner, and run `make test` (what CI runs) N times in a row (default 5).
#
#   scripts/test_under_load.sh [N] [LOG_DIR]
#
# Each run's log goes to LOG_DIR/run-K.log (default /tmp/hetero-spec-load); a summary line per run is
# printed; the exit code is non-zero if any run failed. The clone shares nothing with this checkout but
# the git objects (its own .venv, its own pytest tmp dirs). Stopping the script (Ctrl-C, kill) stops the
# run in progress too: each run is a process group of its own, killed with the busy loops on exit.
set -euo pipefail
N="${1:-5}"
LOG_DIR="${2:-/tmp/hetero-spec-load}"
SRC="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$(mktemp -d /tmp/hetero-spec-clone-XXXXXX)"
mkdir -p "$LOG_DIR"
git clone --quiet "$SRC" "$WORK/repo"
cd "$WORK/repo"
git log --oneline -1
BURNERS=()
RUN=""
cleanup() {
    if [ -n "$RUN" ]; then kill -- "-$RUN" 2>/dev/null || true; fi
    kill "${BURNERS[@]}" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM
for _ in $(seq "$(nproc)"); do
    python3 -c "while True: pass" &
    BURNERS+=($!)
done
echo "load: ${#BURNERS[@]} busy-loop processes (one per core)"
failed=0
for k in $(seq "$N"); do
    start=$(date +%s)
    CI=true setsid bash .ci/run > "$LOG_DIR/run-$k.log" 2>&1 &
    RUN=$!
    if wait "$RUN"; then status=passed; else status=FAILED; failed=1; fi
    RUN=""
    echo "run $k: $status in $(( $(date +%s) - start )) s: $(grep -E '[0-9]+ (passed|failed)' "$LOG_DIR/run-$k.log" | tail -1)"
done
exit $failed
