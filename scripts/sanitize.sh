#!/usr/bin/env bash
# Run scripts/sanitize_cases.py under each compute-sanitizer tool and summarize.
# Usage: bash scripts/sanitize.sh [tool ...]   (default: memcheck racecheck synccheck initcheck)
# Every (tool, kernel setting) pair runs as its own process, all at once: the
# sanitizers' cost is mostly host-side, so the GPU has room for them side by side.
set -u
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-.gpuout}; mkdir -p "$OUT"
tools=${*:-memcheck racecheck synccheck initcheck}
# SANITIZE_SETTINGS (names of sanitize_cases.SETTINGS) narrows the run; default all.
settings=${SANITIZE_SETTINGS:-$(python3 -c "import sys; sys.path.insert(0, 'scripts'); import sanitize_cases; print(*sanitize_cases.SETTINGS)")}
logs=$(mktemp -d)
start=$SECONDS
for tool in $tools; do
  for setting in $settings; do
    compute-sanitizer --tool "$tool" --print-limit 20 python3 scripts/sanitize_cases.py "$setting" \
      > "$logs/$tool-$setting.log" 2>&1 &
  done
done
wait
for tool in $tools; do
  for setting in $settings; do
    log=$logs/$tool-$setting.log
    echo "$tool $setting: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -n 1) | $(grep 'sanitize cases done' "$log" || echo 'cases did not finish')"
    { echo "### $tool $setting"; cat "$log"; } >> "$OUT/sanitize-details.log"
  done
done
echo "all sanitizer runs done in $((SECONDS - start)) s"
