"""my_pkg.devtools.compat.resolver: each lookup rule, and each way a symbol can go missing, on a tiny fake wheel."""

from __future__ import annotations

from my_pkg.devtools.compat import SourceTree, VllmSymbol, check_symbols

from .conftest import FAKE_SOURCES, write_wheel


def test_fake_wheel_lookup_rules_and_reported_problems(tmp_path):
    s = VllmSymbol
    expected = {
        s("vllm", "__version__", "attribute", "x"): "ok",
        s("vllm", "Registry", "attribute", "x"): "ok",  # lazy MODULE_ATTRS -> re-export -> an instance
        s("vllm", "Registry.models", "attribute", "x"): "ok",  # a field of the instance's class
        s("vllm", "OnlyForTypeCheckers", "class", "x"): "missing",  # imported only under TYPE_CHECKING
        s("vllm.layers", "Head.register_oot", "method", "x"): "ok",  # inherited
        s("vllm.layers", "Head.scale", "attribute", "x"): "ok",  # self.scale = ...
        s("vllm.layers", "Head.b", "attribute", "x"): "ok",  # self.a, self.b = ...
        s("vllm.layers", "Head.forward", "method", "x", params=("self", "lm_head", "hidden_states")): "ok",
        s(
            "vllm.layers", "Head.forward", "method", "x", params=("self", "lm_head", "hidden_states", "embedding_bias")
        ): "changed",
        s("vllm.layers", "Head.num_reqs", "attribute", "x"): "ok",  # a property reads as an attribute
        s("vllm.layers", "Head.num_reqs", "method", "x"): "changed",
        s("vllm.layers", "Head.remove_request", "method", "x"): "missing",
        s("vllm.layers", "Head", "function", "x"): "changed",
        s("vllm.layers", "Sub", "class", "x", subclass_of="vllm.layers:Pluggable"): "ok",
        s("vllm.layers", "Pluggable", "class", "x", subclass_of="vllm.layers:Head"): "changed",
        s(
            "vllm.models.registry",
            "Entry",
            "class",
            "x",
            params=("module_name", "class_name"),
            decorator="dataclass(frozen=True)",
        ): "ok",
        s("vllm.models.registry", "_Registry", "class", "x", decorator="dataclass(frozen=True)"): "changed",
        s("vllm.gone", "", "module", "x"): "missing",
        s("vllm.models", "", "module", "x"): "ok",
        s("vllm.models", "gather", "function", "x"): "ok",  # through `from .helpers import *`
        s("vllm.models", "scatter", "function", "x"): "missing",
    }
    tree = SourceTree.from_wheel(write_wheel(tmp_path / "vllm-9.9.9-py3-none-any.whl", FAKE_SOURCES))
    results = check_symbols(tree, tuple(expected))
    assert {(r.symbol, r.status) for r in results} == set(expected.items())
    assert tree.version() == "9.9.9"
