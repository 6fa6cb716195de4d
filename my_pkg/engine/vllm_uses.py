"""Declaring, next to the code, the vLLM names an engine module relies on that its imports do not show.

`my_pkg.devtools.compat` checks every vLLM symbol the engine half touches against a vLLM release's
sources. It derives what each module under `my_pkg/engine` imports from vLLM (`from vllm.x import Y`,
`import vllm.x`, `import_module("vllm.x")`, the `TARGET` string, and attributes read on those imported
names) by itself. What it cannot see is declared by the module that relies on it, as one module-level
constant built only from the helpers below, called with literal arguments:

    VLLM_SYMBOLS = (
        *attributes("vllm.config:ModelConfig", "dtype", "max_model_len"),  # read on a config it is handed
        symbol("vllm.v1.worker.gpu_input_batch:InputBatch.add_request", "method", params=("self", "request")),
    )

A target is `"module:qualname"` (`"module"` alone for the module itself). A declaration of a name the
imports already give replaces the derived entry's kind and adds its constraints: `params` (leading
parameter or dataclass field names a call passes positionally), `subclass_of` (`"module:Class"`) and
`decorator` (as written, `"dataclass(frozen=True)"`).

The checker reads `VLLM_SYMBOLS` with `ast` and never imports an engine module: the patch modules import
vLLM and torch, and a check of another vLLM release (a downloaded wheel, nothing installed) must not need
either. Hence plain literal calls only; this module imports nothing but the standard library, so the
engine pays nothing for its declarations at run time, and devtools calls these same helpers to build them.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["KINDS", "DECLARATION", "Declared", "attributes", "symbol"]

#: What a declared name is in vLLM (an instance attribute, a property and a module-level object are all
#: `attribute`).
KINDS = ("module", "class", "function", "method", "attribute")
#: The module-level constant each engine module declares its vLLM names in.
DECLARATION = "VLLM_SYMBOLS"


class Declared(NamedTuple):
    """One vLLM name an engine module relies on; `qualname` is dotted from `module` (`""`: the module)."""

    module: str
    qualname: str
    kind: str
    params: tuple[str, ...] = ()
    subclass_of: str = ""
    decorator: str = ""


def _split(target: str) -> tuple[str, str]:
    module, _, qualname = target.partition(":")
    if module.split(".")[0] != "vllm" or not all(part.isidentifier() for part in module.split(".")):
        raise ValueError(f"{target!r}: a vLLM target is 'vllm.module:Qualified.name'")
    if qualname and not all(part.isidentifier() for part in qualname.split(".")):
        raise ValueError(f"{target!r}: {qualname!r} is not a dotted name")
    return module, qualname


def symbol(
    target: str, kind: str, *, params: tuple[str, ...] = (), subclass_of: str = "", decorator: str = ""
) -> Declared:
    """One vLLM name of `kind` (one of `KINDS`), with what a call relies on."""
    module, qualname = _split(target)
    if kind not in KINDS:
        raise ValueError(f"{target!r}: kind {kind!r} is not one of {', '.join(KINDS)}")
    if (kind == "module") != (qualname == ""):
        raise ValueError(f"{target!r}: a module target has no ':qualname', every other kind has one")
    if subclass_of:
        _split(subclass_of)
    return Declared(module, qualname, kind, tuple(params), subclass_of, decorator)


def attributes(owner: str, *names: str) -> tuple[Declared, ...]:
    """Attributes read on `owner` (`"module:Class"`, or `"module"` for module-level objects)."""
    module, qualname = _split(owner)
    if not names or not all(name.isidentifier() for name in names):
        raise ValueError(f"{owner!r}: give the attribute names, each an identifier")
    return tuple(Declared(module, f"{qualname}.{name}" if qualname else name, "attribute") for name in names)
