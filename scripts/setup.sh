#!/usr/bin/env bash
# Creates .venv (once) and installs llmserve with its test tools. Sourced by serve.sh and test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
# An unpinned torch would pull several GB of CUDA packages; pin the CPU build where none is installed.
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".[test]"
