#!/usr/bin/env bash
# Run scripts/sanitize_cases.py under each compute-sanitizer tool and summarize.
# Usage: bash scripts/sanitize.sh [tool ...]   (default: memcheck racecheck synccheck initcheck)
set -u
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-.gpuout}; mkdir -p "$OUT"
tools=${*:-memcheck racecheck synccheck initcheck}
for tool in $tools; do
  compute-sanitizer --tool "$tool" --print-limit 20 python3 scripts/sanitize_cases.py \
    > "$OUT/sanitize-$tool.log" 2>&1
  echo "$tool: exit $? | $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize-$tool.log" | tail -n 1) | $(grep 'sanitize cases done' "$OUT/sanitize-$tool.log")"
done
