#!/usr/bin/env bash
# Regenerates docs/results.md (held-out loss of the shared models: BF16, LUT-B with every fitter and
# both activation formats, a stored LUT-B checkpoint, INT3-g128, MXFP4). See scripts/results.py.
#   scripts/results.sh                      # build/release/lutb, ../shared/models -> docs/results.md
#   scripts/results.sh --max-windows 8      # quick trial (says so in the output)
#   scripts/results.sh --calibration        # only the "Calibrated fitting" section (scripts/results_calibration.py)
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--calibration" ]]; then
  shift
  exec python3 scripts/results_calibration.py "$@"
fi
exec python3 scripts/results.py "$@"
