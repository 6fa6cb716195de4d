"""FlashHead imports without Triton and without vLLM (the kernels are checked in test_kernel_backends.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_package_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch\n"
        "from my_pkg.flashhead import FlashHead\n"
        "from my_pkg.flashhead.kernels import triton_available\n"
        "assert not triton_available()\n"
        "h = FlashHead(torch.randn(32, 4), torch.randn(2, 4), torch.arange(32) % 2, n_probes=1)\n"
        "assert h.backend == 'torch'\n"
        "try:\n"
        "    FlashHead(torch.randn(32, 4), torch.randn(2, 4), torch.arange(32) % 2, n_probes=1, backend='triton')\n"
        "except ValueError: print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
    assert "vllm" not in proc.stdout


@pytest.mark.slow
def test_flashhead_does_not_import_vllm():
    code = "import sys, my_pkg.flashhead, my_pkg.cli; print('vllm' in sys.modules)"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.strip() == "False", proc.stderr
