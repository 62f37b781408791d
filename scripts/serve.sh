#!/usr/bin/env bash
# Sets up (first run only) and starts llmserve on the built-in model; extra arguments go to the command.
set -euo pipefail
# shellcheck disable=SC1091
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
if llmserve serve --help >/dev/null 2>&1; then
  exec llmserve serve "$@"
fi
exec llmserve generate --prompt "${PROMPT:-Once upon a time}" "$@"
