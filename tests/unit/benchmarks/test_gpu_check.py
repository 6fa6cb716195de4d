"""bench/gpu_check.py: its CPU mode (Triton interpreter) runs here; the CUDA part needs a GPU."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from my_pkg.flashhead.kernels import triton_available

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "bench" / "gpu_check.py"
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed")


def _run(code: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def _run_script_without_vllm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # `sys.modules["vllm"] = None` makes any vLLM import raise, so a pass proves the script never imports it.
    code = (
        "import runpy, sys\n"
        "sys.modules['vllm'] = None\n"
        f"sys.argv = [{str(SCRIPT)!r}, *{list(args)!r}]\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
    )
    return _run(code, env)


@pytest.mark.slow
@needs_triton
def test_interpret_mode_checks_every_dtype_and_passes(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = _run_script_without_vllm("--interpret", "--json", str(out), env={"TRITON_INTERPRET": ""})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu_check: all checks passed" in proc.stdout
    report = json.loads(out.read_text())
    assert report["environment"]["interpreter"] is True and report["timing"] == []
    cases = report["correctness"]
    assert cases and all(case["passed"] and not case["errors"] for case in cases)
    assert {case["dtype"] for case in cases} == {"fp32", "fp16", "bf16"}
    shaped = [case for case in cases if case["vocab"]]
    # Odd sizes: a vocabulary that leaves padded clusters, hidden sizes that are not a multiple of the block.
    assert any(case["vocab"] % 16 for case in shaped) and any(case["hidden"] % 128 for case in shaped)
    assert all(0 < case["logits_max_error"] < 0.1 for case in shaped)
    assert sum("tie rule" in case["name"] for case in cases) == 3
    assert proc.stdout.count("\nok   ") == len(cases)


def test_without_cuda_it_explains_and_exits_2():
    proc = _run_script_without_vllm(env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stdout and "--interpret" in proc.stdout


@pytest.mark.slow
@needs_triton
def test_checks_fail_on_broken_kernels():
    # The checker itself must be able to fail: break each Triton kernel in turn and look for the failure.
    code = f"""
import importlib.util, os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
spec = importlib.util.spec_from_file_location("gpu_check", {str(SCRIPT)!r})
gc = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gc)
from my_pkg.flashhead.kernels import triton_kernels
good_logits = triton_kernels.candidate_logits
head = gc.RandomHead.make(333, 129, torch.float16, torch.device("cpu"), seed=0)
assert gc.check_case(head, 2, seed=1).passed

def off_by_a_bit(*args, **kw):
    ids, logits = good_logits(*args, **kw)
    logits[0, 5] += 0.25
    return ids, logits
triton_kernels.candidate_logits = off_by_a_bit
print("logits:", gc.check_case(head, 2, seed=1).errors)

def best_is_worst(*args, **kw):
    ids, logits = good_logits(*args, **kw)
    return ids, -logits
triton_kernels.candidate_logits = best_is_worst
print("step:", gc.check_case(head, 2, seed=1).errors)
print("ties:", gc.check_ties(torch.float32, torch.device("cpu")).errors)
triton_kernels.candidate_logits = good_logits
"""
    proc = _run(code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(line.split(":", 1) for line in proc.stdout.splitlines() if ":" in line)
    assert "stage 2: Triton logits off by" in lines["logits"]
    assert "step:" in lines["step"] and "full probes:" in lines["step"]
    assert "expected token 9" in lines["ties"]


def test_script_imports_no_vllm_module():
    tree = ast.parse(SCRIPT.read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported and not any(name == "vllm" or name.startswith("vllm.") for name in imported)
