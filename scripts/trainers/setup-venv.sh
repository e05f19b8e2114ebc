#!/usr/bin/env bash
# Makes .cache/venv-trainers: the drafter trainers (speculators + hs-connectors, specforge) and
# layertap's Python client, for scripts/trainers/check_readers.py (`make trainer-readers`).
# About 4 GB (torch). CPU is enough.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.cache/venv-trainers
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet -r scripts/trainers/requirements.txt
"$VENV/bin/pip" install --quiet --no-deps specforge==0.2.0
# imported by SpecForge's draft models (its sequence-parallel attention); needs only torch
"$VENV/bin/pip" install --quiet --no-deps yunchang
"$VENV/bin/pip" install --quiet -e './clients/python[test]'
"$VENV/bin/python" -c "import torch, speculators, hs_connectors, specforge; print('trainers venv ready: torch', torch.__version__)"
