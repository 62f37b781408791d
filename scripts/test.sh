#!/usr/bin/env bash
# Sets up (first run only) and runs the linter and the test suite; extra arguments go to pytest.
set -euo pipefail
# shellcheck disable=SC1091
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
ruff check llmserve tests benchmarks
python -m pytest -q -p no:cacheprovider "$@"
