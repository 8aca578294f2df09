#!/usr/bin/env bash
# The test command of the README (and of CI): set up, then every CPU tier of the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_DEFAULT_FP_FUSION=1
# loadgroup: the tests go out one at a time (slow ones first: tests/conftest.py), each xdist_group to one
# worker (tests that share an interpreter run), so that neither of the two workers idles at the end
exec ${PYTHON:-python3} -m pytest -n 2 --dist loadgroup -q -p no:cacheprovider "$@"
