#!/usr/bin/env bash
# What one device call carries: the tracked files, the untracked files git does not ignore, and the carried paths
# given as arguments (e.g. .gpu). Prints each part and the total in MiB; exits 1 at LIMIT_MIB (default 60) or more.
# Usage: scripts/travel_size.sh [CARRIED_PATH ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bytes() { xargs -0 -r du -cb --apparent-size 2>/dev/null | awk '/\ttotal$/ {s += $1} END {print s + 0}'; }
tracked=$(git ls-files -z | bytes)
untracked=$(git ls-files -z -o --exclude-standard | bytes)
carried=0
for p in "$@"; do
  [ -e "$p" ] && carried=$((carried + $(du -sb --apparent-size "$p" | cut -f1)))
done
total=$((tracked + untracked + carried))
limit=${LIMIT_MIB:-60}
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
echo "travels: tracked $(mib "$tracked") MiB + untracked $(mib "$untracked") MiB + carried ($*) $(mib "$carried") MiB = $(mib "$total") MiB (limit ${limit} MiB; the device refuses over 64)"
if [ "$total" -ge $((limit * 1048576)) ]; then
  echo "travel_size: over ${limit} MiB" >&2
  exit 1
fi
