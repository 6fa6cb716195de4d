"""Shared by the compat tests: the repository root and a tiny fake vLLM wheel that shows each lookup rule."""

from __future__ import annotations

import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]

FAKE_SOURCES = {
    "vllm/__init__.py": (
        "from typing import TYPE_CHECKING\n"
        "from .version import __version__\n"
        "MODULE_ATTRS = {'Registry': '.models:Registry'}\n"
        "if TYPE_CHECKING:\n"
        "    from vllm.layers import Head as OnlyForTypeCheckers\n"
        "def __getattr__(name):\n"
        "    raise AttributeError(name)\n"
    ),
    "vllm/version.py": "__version__: str\n__version__ = version = '9.9.9'\n",
    "vllm/models/__init__.py": "from .registry import Registry\nfrom .helpers import *\n",
    "vllm/models/helpers.py": "def gather(x):\n    return x\n",
    "vllm/models/registry.py": (
        "from dataclasses import dataclass, field\n"
        "class _Registry:\n"
        "    models: dict = field(default_factory=dict)\n"
        "Registry = _Registry()\n"
        "@dataclass(frozen=True)\n"
        "class Entry:\n"
        "    module_name: str\n"
        "    class_name: str\n"
    ),
    "vllm/layers.py": (
        "from torch import nn\n"
        "class Pluggable(nn.Module):\n"
        "    @classmethod\n"
        "    def register_oot(cls, layer=None):\n"
        "        return layer\n"
        "class Head(Pluggable):\n"
        "    def __init__(self, scale):\n"
        "        self.scale = scale\n"
        "        self.a, self.b = 1, 2\n"
        "    def forward(self, lm_head, hidden_states):\n"
        "        return hidden_states\n"
        "    @property\n"
        "    def num_reqs(self):\n"
        "        return 0\n"
        "class Sub(Head):\n"
        "    pass\n"
    ),
}


def write_wheel(path: Path, sources: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in sources.items():
            archive.writestr(name, text)
    return path
