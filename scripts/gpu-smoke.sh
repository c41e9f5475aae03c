#!/usr/bin/env bash
# The GPU smoke check: on a GPU machine that reaches the package registries, set up with CUDA
# vLLM 0.32 and torch, run the tests marked `gpu`, then a 20-step demo on the GPU, and print one
# line per check: "ok", "FAIL" or "skipped", with what it saw. Exit 1 if one failed.
#
#   scripts/gpu-smoke.sh             # set up .venv-gpu (pip install -e ".[gpu,test]"), then check
#   scripts/gpu-smoke.sh --installed # no install: with the python on PATH (and PYTHONPATH set to
#                                    # this checkout), every check whose packages are there. With
#                                    # torch, transformers, pytest and msgspec plus DeepSpeed's
#                                    # pure-Python wheel: DeepSpeed on CUDA (ZeRO-0, ZeRO-3 bf16 and
#                                    # its gather), the learner step, the bucket format, the
#                                    # transformers engine, the colocated weight pass (CUDA IPC);
#                                    # NCCL between members with 2+ GPUs; the
#                                    # demo only where vLLM, Ray and Redis import.
# flash-attention 2 is opt-in (pip install -e ".[flash]"): without it the learner uses SDPA.
# Logs go to runs/gpu-smoke/.
set -u
cd "$(dirname "$0")/.."
LOGS=runs/gpu-smoke
mkdir -p "$LOGS"
failed=0
line() { printf '%-10s %-7s %s\n' "$1" "$2" "$3"; [ "$2" = FAIL ] && failed=1; return 0; }

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >"$LOGS/gpus.txt" 2>&1; then
    line gpus skipped "no NVIDIA GPU here (nvidia-smi): nothing to check"
    exit 0
fi
line gpus ok "$(wc -l <"$LOGS/gpus.txt") GPU(s): $(head -1 "$LOGS/gpus.txt")"

if [ "${1:-}" = --installed ]; then
    PY=$(command -v python3)
else
    if python3 -m venv .venv-gpu >"$LOGS/setup.log" 2>&1 &&
        .venv-gpu/bin/pip install -e ".[gpu,test]" >>"$LOGS/setup.log" 2>&1; then
        line setup ok ".venv-gpu: $(.venv-gpu/bin/python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)')"
    else
        line setup FAIL "pip install -e .[gpu,test]: see $LOGS/setup.log"
        exit 1
    fi
    PY=.venv-gpu/bin/python
fi
for pkg in torch deepspeed vllm flash_attn; do
    if version=$("$PY" -c "import $pkg; print($pkg.__version__)" 2>/dev/null | tail -1) && [ -n "$version" ]; then
        line "$pkg" ok "$version"
    else
        line "$pkg" skipped "does not import with $PY: the checks that need it are skipped"
    fi
done

# the tests marked gpu: a test whose package is missing is skipped by pytest.importorskip
if "$PY" -m pytest tests -m gpu -q -rs -p no:cacheprovider >"$LOGS/tests.log" 2>&1; then
    line tests ok "$(tail -1 "$LOGS/tests.log")"
else
    line tests FAIL "$(tail -1 "$LOGS/tests.log") (see $LOGS/tests.log)"
fi

if "$PY" -c "import vllm, ray, redis" 2>/dev/null; then
    if timeout 600 "$PY" -m async_rlhf.launch.cli train --config configs/demo.yaml --job gpu-smoke \
        --out "$LOGS/demo" learner.steps=20 >"$LOGS/demo.log" 2>&1 && grep -q "lost=0" "$LOGS/demo.log"; then
        line demo ok "$(grep -E '^start-up|^step +20/' "$LOGS/demo.log" | tr -s ' ' | paste -sd ';')"
    else
        line demo FAIL "20 steps of configs/demo.yaml: see $LOGS/demo.log"
    fi
else
    line demo skipped "vLLM, Ray or Redis does not import with $PY"
fi
exit $failed
