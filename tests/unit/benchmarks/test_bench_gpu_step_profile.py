"""`bench/experiments/gpu_step_profile.py`: it measures a GPU step only; without CUDA it says so and exits 2."""

import pytest
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_32_bit_keys_choose_the_served_probes_in_the_served_order(dtype):
    from my_pkg.flashhead.probes import select_probes

    g = torch.Generator().manual_seed(0)
    # Few distinct values: many ties, which the smaller cluster id wins; negative scores and both zeros included.
    scores = (torch.randint(-40, 40, (6, 3000), generator=g).float() / 8).to(dtype)
    scores[:, :5] = torch.tensor([-0.0, 0.0, -0.0, 0.0, -1.0], dtype=dtype)
    for n_probes in (1, 37, 400, 3000):
        want = select_probes(scores, n_probes)
        assert torch.equal(gpu_step_profile.half_precision_probes(scores, n_probes), want)


def test_32_bit_keys_refuse_what_they_cannot_order():
    with pytest.raises(ValueError, match="32-bit keys"):
        gpu_step_profile.half_precision_probes(torch.zeros(1, 8), 2)
    with pytest.raises(ValueError, match="32-bit keys"):
        gpu_step_profile.half_precision_probes(torch.zeros(1, (1 << 16) + 1, dtype=torch.bfloat16), 2)
