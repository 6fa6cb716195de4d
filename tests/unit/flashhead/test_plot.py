"""``plot_fidelity`` and ``my-pkg flashhead eval --plot``: the PNG (matplotlib optional)."""

import builtins
import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from my_pkg.cli import main
from my_pkg.flashhead.curves import fidelity_curves
from my_pkg.flashhead.synthetic import synthetic_head, synthetic_hidden_states

V, H = 512, 32


def _png_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` of a PNG, checking its signature and that the first chunk is IHDR."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_fidelity_writes_a_png(head_and_states, tmp_path):
    pytest.importorskip("matplotlib")
    from my_pkg.flashhead.plot import plot_fidelity

    head, hidden = head_and_states
    curves = fidelity_curves(head, hidden, [1, 2, 4, 8])
    path = plot_fidelity(tmp_path / "f.png", curves, served_n_probes=4, target_agreement=0.99, title="t")
    assert _png_size(path.read_bytes()) == (1000, 400)
    with pytest.raises(ValueError, match="no probe counts"):
        plot_fidelity(tmp_path / "g.png", type(curves)([], [], 4, 8), served_n_probes=4)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from tests.unit.flashhead.conftest import write_checkpoint

    root = tmp_path_factory.mktemp("plot")
    weight = synthetic_head(V, H, seed=1)
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": H, "vocab_size": V, "tie_word_embeddings": False}
    model = write_checkpoint(root / "model", {"lm_head.weight": weight, "model.norm.weight": torch.ones(H)}, config)
    assert main(["flashhead", "build", str(model), "--no-progress", "--iterations", "3", "--n-probes", "4"]) == 0
    states = root / "states.safetensors"
    save_file({"hidden_states": synthetic_hidden_states(weight, 200, seed=3)}, str(states))
    return model, states


def test_eval_plot_writes_a_png_and_keeps_json_output_clean(built, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    model, states = built
    png = tmp_path / "fidelity.png"
    assert main(["flashhead", "eval", str(model), "--hidden", str(states), "--json", "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["results"][0]["n_probes"] == 4  # stdout is still the JSON alone
    assert f"wrote {png}" in captured.err
    width, height = _png_size(png.read_bytes())
    assert width > 0 and height > 0


def test_eval_plot_without_matplotlib_fails_clearly_before_any_work(built, tmp_path, capsys, monkeypatch):
    model, states = built
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    png = tmp_path / "fidelity.png"
    assert main(["flashhead", "eval", str(model), "--hidden", str(states), "--plot", str(png)]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("my-pkg: error: --plot needs matplotlib") and "pip install 'my-pkg[plot]'" in err
    assert len(err.splitlines()) == 1 and captured.out == "" and not png.exists()
