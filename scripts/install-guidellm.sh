#!/usr/bin/env bash
# Installs guidellm (https://github.com/vllm-project/guidellm) into its own virtualenv, for the
# third-party benchmark (benchmarks/thirdparty, `make bench-thirdparty`).
# Idempotent: a finished install leaves a stamp file and is reused.
set -euo pipefail

GUIDELLM_VERSION="${GUIDELLM_VERSION:-0.8.1}"
# guidellm requires torch; the "+cpu" local version makes pip fail at once rather than fetch a
# multi-GB CUDA build (these machines carry it on disk; elsewhere add PyTorch's CPU index via
# PIP_EXTRA_INDEX_URL).
TORCH_VERSION="${GUIDELLM_TORCH_VERSION:-2.13.0+cpu}"
VENV="${MINERU_GUIDELLM_VENV:-$HOME/.cache/mineru-gateway/guidellm-$GUIDELLM_VERSION}"
PY="${PYTHON:-python3.11}"
STAMP="$VENV/.mineru-gateway-installed"

if [[ -f "$STAMP" ]]; then
    echo "guidellm $GUIDELLM_VERSION: reusing $VENV"
    exit 0
fi
command -v "$PY" >/dev/null || PY=python3
echo "guidellm $GUIDELLM_VERSION: installing into $VENV (a few minutes)"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# Install the CPU torch first so the resolver never reaches for a CUDA build.
"$VENV/bin/pip" install --quiet "torch==$TORCH_VERSION"
"$VENV/bin/pip" install --quiet "guidellm==$GUIDELLM_VERSION" "torch==$TORCH_VERSION"
"$VENV/bin/guidellm" --version
touch "$STAMP"
