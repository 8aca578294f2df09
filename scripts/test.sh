#!/usr/bin/env bash
# The test command of the README (and of CI): set up, then every CPU tier of the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_DEFAULT_FP_FUSION=1
exec ${PYTHON:-python3} -m pytest -n 2 -q -p no:cacheprovider "$@"
