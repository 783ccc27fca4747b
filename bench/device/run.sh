#!/usr/bin/env bash
# The prepared device run: reference target conversion → regeneration → cache → training of each
# drafter (same budget) → eval, in ≤ 9 minutes on one GPU; writes device_run.json, device_run.md and
# device_run.logs.tar.gz to $OUT (else bench/results/).  See bench/device/README.md.
#   bash bench/device/run.sh                      # GPU machine (DEVICE_PROMPTS: a prompt JSONL)
#   TINY=1 bash bench/device/run.sh               # tiny target on a CPU (what tests/integration runs)
# PYTHON picks the interpreter (default: .venv/bin/python if there is one, else python3);
# DEVICE_RUN_TIMEOUT caps the whole run (default 560 s, inside a 10-minute limit per command; the
# stages themselves stop within DEVICE_BUDGET_S = 520 s).
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [ -z "${EVAL_DATA:-}" ] && [ -d .device-eval ]; then export EVAL_DATA="$PWD/.device-eval"; fi
exec timeout -k 10 "${DEVICE_RUN_TIMEOUT:-560}" "$PYTHON" bench/device/run.py "$@"
