"""`bench/experiments/gpu_step_profile.py`: it measures a GPU step only; without CUDA it says so and exits 2."""

import torch

from bench.experiments import gpu_step_profile


def test_without_cuda_it_explains_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_step_profile.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().out


def test_the_report_sums_every_kernel_and_lists_the_costliest_first(capsys):
    gpu_step_profile._report("greedy", {"topk": (0.1, 2), "gemv": (0.3, 1)}, wall_ms=0.5)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "  greedy: wall 0.5000 ms, kernels 0.4000 ms in 3 launches"
    assert [line.split()[-1] for line in lines[1:]] == ["gemv", "topk"]
