#!/usr/bin/env bash
# Sets up (first run only) and runs the linter and the test suite; extra arguments go to pytest.
set -euo pipefail
# shellcheck disable=SC1091
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
ruff check llmserve tests benchmarks
# Two workers, each taking whole files (module fixtures start once): 12:10 against 16:22 serial on an AVX2-only
# 2-core machine (BENCHMARKS.md). `-n 0` after it runs serially.
python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile "$@"
