"""Does a vLLM release still have every vLLM symbol the engine half touches? Checked statically.

    python -m my_pkg.devtools.compat                          # vLLM 0.33.0, downloaded once and cached
    python -m my_pkg.devtools.compat --vllm-version 0.34.0
    python -m my_pkg.devtools.compat --wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
    python -m my_pkg.devtools.compat --installed              # the vLLM installed next to this package

The wheel is fetched with ``pip download vllm==X --no-deps --only-binary=:all:`` into a cache
folder and read as a zip: nothing is installed or imported, only its ``.py`` sources are parsed
with ``ast``. Each entry of ``ENGINE_SYMBOLS`` is looked up the way Python would find it at run
time: module-level definitions and imports (re-exports are followed, ``if TYPE_CHECKING`` blocks
are not), lazy ``__getattr__`` maps such as ``vllm.MODULE_ATTRS``, class bodies, ``self.x = ...``
assignments in methods, and base classes. Some entries also pin what a call relies on: leading
parameter names, a base class, a decorator.

Exit status: 0 every symbol found, 1 some missing or changed (listed), 2 the sources could not be read.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "VllmSymbol",
    "SymbolCheck",
    "SourceTree",
    "ENGINE_SYMBOLS",
    "DEFAULT_VLLM_VERSION",
    "check_symbols",
    "fetch_wheel",
    "main",
]

DEFAULT_VLLM_VERSION = "0.33.0"
KINDS = ("module", "class", "function", "method", "attribute")
EXIT_OK, EXIT_MISSING, EXIT_NO_SOURCES = 0, 1, 2
_MAX_IMPORT_HOPS = 12


@dataclass(frozen=True)
class VllmSymbol:
    """One vLLM name the engine half relies on.

    ``qualname`` is dotted from ``module`` (``""`` for the module itself); ``kind`` is one of
    ``KINDS`` (an instance attribute, a property and a module-level object are all ``attribute``).
    """

    module: str
    qualname: str
    kind: str
    used_by: str
    params: tuple[str, ...] = ()  # leading parameter (or dataclass field) names a call passes positionally
    subclass_of: str = ""  # "module:Class" a class must derive from
    decorator: str = ""  # a decorator a class must keep, as written (``dataclass(frozen=True)``)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}" if self.qualname else self.module


def _symbols() -> tuple[VllmSymbol, ...]:
    worker, runner = "vllm.v1.worker.worker_base", "vllm.v1.worker.gpu_model_runner"
    batch = "vllm.v1.worker.gpu_input_batch"
    logits, registry = "vllm.model_executor.layers.logits_processor", "vllm.model_executor.models.registry"
    rpc, lp, mr = "engine/rpc.py", "engine/patches/logits_processor.py", "engine/patches/model_runner.py"
    reg, hooks, rows = "engine/patches/model_registry.py", "engine/patches/runner_hooks.py", "engine/flashhead/rows.py"
    gpu, mr2 = "vllm.v1.worker.gpu", "engine/patches/model_runner_v2.py"
    vocab = "vllm.model_executor.layers.vocab_parallel_embedding"
    v2 = f"{gpu}.model_runner"
    s = VllmSymbol
    return (
        # patches/worker.py and rpc.py: methods attached to every worker; what they read on it.
        s("vllm", "", "module", rpc),
        s("vllm", "__version__", "attribute", rpc),
        s(worker, "WorkerBase", "class", "engine/patches/worker.py"),
        *(
            s(worker, f"WorkerBase.{name}", "attribute", rpc)
            for name in (
                "rank",
                "local_rank",
                "device",
                "model_runner",
                "model_config",
                "cache_config",
                "parallel_config",
                "scheduler_config",
            )
        ),
        s(runner, "GPUModelRunner.kv_caches", "attribute", rpc),
        s("vllm.config", "ParallelConfig.world_size", "attribute", rpc),
        *(
            s("vllm.config", f"ModelConfig.{name}", "attribute", users)
            for name, users in (
                ("model", f"{rpc}, {lp}"),
                ("dtype", f"{rpc}, {lp}"),
                ("served_model_name", rpc),
                ("max_model_len", rpc),
                ("revision", lp),
                ("hf_config", lp),
                ("head_dtype", lp),
            )
        ),
        s("vllm.config", "CacheConfig.block_size", "attribute", rpc),
        s("vllm.config", "CacheConfig.num_gpu_blocks", "attribute", rpc),
        # patches/model_registry.py and flashhead_model_entry.py: FlashHead architectures.
        s("vllm", "ModelRegistry", "attribute", reg),
        s("vllm", "ModelRegistry.models", "attribute", reg),
        s(
            registry,
            "_LazyRegisteredModel",
            "class",
            f"{reg}, engine/patches/flashhead_model_entry.py",
            params=("module_name", "class_name"),
            decorator="dataclass(frozen=True)",
        ),
        s(registry, "_LazyRegisteredModel.module_name", "attribute", reg),
        s(registry, "_LazyRegisteredModel.class_name", "attribute", reg),
        s(
            registry,
            "_LazyRegisteredModel.load_model_cls",
            "method",
            "engine/patches/flashhead_model_entry.py",
            params=("self",),
        ),
        # patches/logits_processor.py: the out-of-tree LogitsProcessor and the configuration it reads.
        s("vllm.config", "get_current_vllm_config", "function", lp),
        *(
            s("vllm.config", f"VllmConfig.{name}", "attribute", lp)
            for name in ("model_config", "parallel_config", "speculative_config", "lora_config")
        ),
        s("vllm.config", "VllmConfig.use_v2_model_runner", "attribute", "engine/patches/__init__.py"),
        s("vllm.config", "get_current_vllm_config_or_none", "function", "engine/patches/__init__.py"),
        s("vllm.config", "ParallelConfig.pipeline_parallel_size", "attribute", lp),
        s("vllm.model_executor.custom_op", "op_registry_oot", "attribute", lp),
        s(logits, "LogitsProcessor", "class", lp),
        s(
            logits,
            "LogitsProcessor.forward",
            "method",
            lp,
            params=("self", "lm_head", "hidden_states", "embedding_bias", "skip_gather"),
        ),
        s(logits, "LogitsProcessor.register_oot", "method", lp),
        *(
            s(logits, f"LogitsProcessor.{name}", "attribute", lp)
            for name in ("logits_as_input", "org_vocab_size", "soft_cap", "scale")
        ),
        s("vllm.lora.layers.logits_processor", "LogitsProcessorWithLoRA.base_layer", "attribute", lp),
        s(
            "vllm.model_executor.layers.vocab_parallel_embedding",
            "VocabParallelEmbedding.quant_method",
            "attribute",
            lp,
        ),
        s("vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod", "class", lp),
        s("vllm.model_executor.layers.linear", "UnquantizedLinearMethod", "class", lp),
        # patches/model_runner.py: the V1 runner's decode step and its input batch.
        s(batch, "InputBatch", "class", mr),
        s(batch, "InputBatch.add_request", "method", mr, params=("self", "request")),
        s(batch, "InputBatch.remove_request", "method", mr, params=("self", "req_id")),
        *(
            s(batch, f"InputBatch.{name}", "attribute", mr)
            for name in ("num_reqs", "req_id_to_index", "temperature_cpu", "logitsprocs")
        ),
        s(batch, "CachedRequestState.req_id", "attribute", mr),
        s(batch, "CachedRequestState.sampling_params", "attribute", mr),
        s("vllm.v1.sample.logits_processor.state", "LogitsProcessors.all", "attribute", mr),
        *(
            s("vllm.v1.sample.logits_processor.builtin", name, "class", mr)
            for name in ("MinPLogitsProcessor", "LogitBiasLogitsProcessor", "MinTokensLogitsProcessor")
        ),
        s(runner, "GPUModelRunner", "class", mr),
        s(runner, "GPUModelRunner.execute_model", "method", mr, params=("self",)),
        s(runner, "GPUModelRunner.get_model", "method", hooks, params=("self",)),
        s(runner, "GPUModelRunner.load_model", "method", f"{mr}, {hooks}", params=("self",)),
        s(runner, "GPUModelRunner.input_batch", "attribute", mr),
        s(runner, "GPUModelRunner.model", "attribute", hooks),
        s(runner, "GPUModelRunner.model_config", "attribute", hooks),
        s("vllm.config", "ModelConfig.enable_sleep_mode", "attribute", hooks),
        s("vllm.v1.worker.cpu_model_runner", "CPUModelRunner", "class", mr, subclass_of=f"{runner}:GPUModelRunner"),
        s("vllm.v1.worker.cpu_model_runner", "CPUModelRunner.load_model", "method", mr, params=("self",)),
        # Speculative decoding (V1): the step's draft counts and metadata, and what tells a drafter apart.
        s(
            runner,
            "GPUModelRunner._calc_spec_decode_metadata",
            "method",
            mr,
            params=("self", "num_draft_tokens", "cu_num_scheduled_tokens"),
        ),
        s(runner, "GPUModelRunner.speculative_config", "attribute", mr),
        s("vllm.v1.spec_decode.metadata", "SpecDecodeMetadata.draft_token_ids", "attribute", mr),
        *(
            s("vllm.config", f"SpeculativeConfig.{name}", "attribute", "engine/flashhead/spec.py, " + mr)
            for name in ("method", "num_speculative_tokens", "draft_sample_method")
        ),
        s("vllm.compilation.backends", "", "module", lp),
        s("vllm.compilation.backends", "model_tag", "attribute", lp),
        # patches/runner_hooks.py: the head built right after the weights load, over the model's LM head.
        s(vocab, "VocabParallelEmbedding", "class", hooks),
        s(vocab, "ParallelLMHead", "class", hooks, subclass_of=f"{vocab}:VocabParallelEmbedding"),
        # patches/model_runner_v2.py: Model Runner V2's sampling step, sampler slots and input batch.
        s(v2, "GPUModelRunner", "class", mr2),
        s(v2, "GPUModelRunner.sample", "method", mr2, params=("self", "hidden_states", "input_batch")),
        s(v2, "GPUModelRunner.load_model", "method", mr2, params=("self",)),
        s(v2, "GPUModelRunner.get_model", "method", hooks, params=("self",)),
        s(v2, "GPUModelRunner.sampler", "attribute", mr2),
        s(v2, "GPUModelRunner.batch_sharder", "attribute", mr2),
        s(f"{gpu}.sample.sampler", "Sampler", "class", mr2),
        s(f"{gpu}.sample.sampler", "Sampler.add_request", "method", mr2, params=("self", "req_idx", "sampling_params")),
        s(f"{gpu}.sample.sampler", "Sampler.sampling_states", "attribute", mr2),
        s(f"{gpu}.sample.sampler", "Sampler.logits_processors", "attribute", mr2),
        *(
            s(f"{gpu}.sample.states", f"SamplingStates.{name}", "attribute", mr2)
            for name in ("max_num_reqs", "temperature")
        ),
        s(f"{gpu}.buffer_utils", "UvaBackedTensor.np", "attribute", mr2),
        *(
            s(f"{gpu}.input_batch", f"InputBatch.{name}", "attribute", mr2)
            for name in ("num_reqs", "idx_mapping_np", "cu_num_logits_np")
        ),
        s(f"{gpu}.sample.logit_bias", "LogitBiasState", "class", mr2),
        s(f"{gpu}.sample.penalties", "PenaltiesState", "class", mr2),
        s(f"{gpu}.sample.bad_words", "BadWordsState", "class", mr2),
        # flashhead/rows.py: request fields that decide dense vs FlashHead (DENSE_REQUEST_FIELDS and more),
        # and the ids vLLM stops a request on.
        *(
            s("vllm.sampling_params", f"SamplingParams.{name}", "attribute", rows)
            for name in (
                "logprobs",
                "logprob_token_ids",
                "structured_outputs",
                "logit_bias",
                "allowed_token_ids",
                "bad_words",
                "thinking_token_budget",
                "watermarking",
                "extra_args",
                "stop_token_ids",
                "all_stop_token_ids",
                "temperature",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
            )
        ),
        # patches/logits_processor.py: the EOS and special ids of the tokenizer vLLM loads.
        s("vllm.tokenizers.registry", "cached_tokenizer_from_config", "function", lp, params=("model_config",)),
    )


#: Every vLLM symbol the engine half (``my_pkg/engine``) touches. Unit tests fail when a ``vllm`` import of
#: the engine, or an attribute read on an imported vLLM name, is missing here; attributes read on vLLM
#: objects the engine is handed (``input_batch.num_reqs``, ``vllm_config.lora_config``) are listed by hand.
ENGINE_SYMBOLS: tuple[VllmSymbol, ...] = _symbols()


# ---- the sources of one vLLM distribution -------------------------------------------------------


class SourceTree:
    """The ``.py`` files of a vLLM distribution, parsed on demand; never imported.

    ``read(path)`` returns the text of a path such as ``vllm/config/__init__.py``, or None.
    """

    def __init__(self, read: Callable[[str], str | None], origin: str) -> None:
        self._read = read
        self.origin = origin
        self._parsed: dict[str, ast.Module | None] = {}
        self.files_read: set[str] = set()

    @classmethod
    def from_wheel(cls, wheel: str | Path) -> SourceTree:
        try:
            archive = zipfile.ZipFile(wheel)
        except (OSError, zipfile.BadZipFile) as exc:
            raise CompatError(f"cannot open {wheel} as a wheel: {exc}") from exc
        names = set(archive.namelist())

        def read(path: str) -> str | None:
            return archive.read(path).decode("utf-8") if path in names else None

        return cls(read, str(wheel))

    @classmethod
    def from_directory(cls, site: str | Path) -> SourceTree:
        """Sources under ``site`` (the folder that holds the ``vllm`` package)."""
        root = Path(site)

        def read(path: str) -> str | None:
            file = root / path
            return file.read_text(encoding="utf-8") if file.is_file() else None

        return cls(read, str(root / "vllm"))

    @classmethod
    def installed(cls) -> SourceTree:
        """The vLLM importable from this interpreter (located, not imported)."""
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            raise CompatError("vLLM is not installed in this environment")
        return cls.from_directory(Path(list(spec.submodule_search_locations)[0]).parent)

    def _path(self, module: str) -> tuple[str, bool] | None:
        base = module.replace(".", "/")
        for path, is_package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
            if path not in self._parsed:
                text = self._read(path)
                if text is not None:
                    self.files_read.add(path)
                self._parsed[path] = ast.parse(text, filename=path) if text is not None else None
            if self._parsed[path] is not None:
                return path, is_package
        return None

    def module(self, module: str) -> ast.Module | None:
        found = self._path(module)
        return self._parsed[found[0]] if found else None

    def is_package(self, module: str) -> bool:
        found = self._path(module)
        return bool(found and found[1])

    def version(self) -> str | None:
        """``vllm.__version__`` when it is a string literal somewhere along its imports."""
        found = _Resolver(self).lookup("vllm", "__version__")
        value = getattr(found, "value", None) if found else None
        return value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else None


class CompatError(RuntimeError):
    """The vLLM sources could not be obtained."""


# ---- name resolution ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Found:
    """What a name resolved to. ``kind``: module, class, function, method, attribute (property
    included), instance (a module-level object made by calling a class), or external (imported
    from outside vLLM: present, not inspected)."""

    kind: str
    module: str
    node: ast.AST | None = None
    value: ast.AST | None = None  # assigned value, for attributes
    instance_of: _Found | None = None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that run at import time, through if/try/with blocks (not ``if TYPE_CHECKING``)."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            if not _is_type_checking(stmt.test):
                yield from _runtime_statements(stmt.body)
            yield from _runtime_statements(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody):
                yield from _runtime_statements(block)
        elif isinstance(stmt, ast.With):
            yield from _runtime_statements(stmt.body)
        else:
            yield stmt


def _target_names(target: ast.expr) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _target_names(element)


def _is_property(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for decorator in func.decorator_list:
        text = ast.unparse(decorator)
        if text.split(".")[-1] in ("property", "cached_property") or text.endswith((".setter", ".getter")):
            return True
    return False


class _Resolver:
    def __init__(self, tree: SourceTree) -> None:
        self.tree = tree

    def lookup(self, module: str, qualname: str) -> _Found | None:
        if self.tree.module(module) is None:
            return None
        found: _Found | None = _Found("module", module)
        for part in qualname.split(".") if qualname else ():
            found = self.member(found, part) if found is not None else None
        return found

    def member(self, found: _Found, name: str) -> _Found | None:
        if found.kind == "module":
            return self.module_member(found.module, name)
        if found.kind == "class":
            return self.class_member(found, name, set())
        if found.kind == "instance" and found.instance_of is not None:
            return self.class_member(found.instance_of, name, set())
        if found.kind == "external":
            return found
        return None

    # -- modules --------------------------------------------------------------------------------

    def _absolute(self, module: str, level: int, name: str | None) -> str:
        if level == 0:
            return name or ""
        parts = module.split(".")
        if not self.tree.is_package(module):
            parts = parts[:-1]
        parts = parts[: len(parts) - (level - 1)]
        return ".".join(parts + ([name] if name else []))

    def module_member(self, module: str, name: str, hops: int = 0) -> _Found | None:
        tree = self.tree.module(module)
        if tree is None or hops > _MAX_IMPORT_HOPS:
            return None
        annotated: _Found | None = None
        for stmt in _runtime_statements(tree.body):
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                return _Found("class", module, stmt)
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return _Found("function", module, stmt)
            if isinstance(stmt, ast.Assign) and any(name in _target_names(t) for t in stmt.targets):
                return self._assigned(module, stmt, stmt.value, hops)
            if isinstance(stmt, ast.AnnAssign) and name in _target_names(stmt.target):
                if stmt.value is not None:
                    return self._assigned(module, stmt, stmt.value, hops)
                annotated = annotated or _Found("attribute", module, stmt)
            if isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        return self._imported(self._absolute(module, stmt.level, stmt.module), alias.name, hops)
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname == name or (alias.asname is None and alias.name.split(".")[0] == name):
                        target = alias.name if alias.asname else name  # `import a.b` binds `a`
                        return _Found("module" if self.tree.module(target) else "external", target)
        lazy = self._lazy_attribute(module, tree, name, hops)
        if lazy is not None:
            return lazy
        if self.tree.module(f"{module}.{name}") is not None:
            return _Found("module", f"{module}.{name}")
        return annotated

    def _imported(self, source: str, name: str, hops: int) -> _Found | None:
        if source.split(".")[0] != "vllm":
            return _Found("external", source)
        found = self.module_member(source, name, hops + 1)
        if found is None and self.tree.module(f"{source}.{name}") is not None:
            return _Found("module", f"{source}.{name}")
        return found

    def _assigned(self, module: str, stmt: ast.stmt, value: ast.expr, hops: int) -> _Found:
        if isinstance(value, (ast.Name, ast.Attribute)):
            alias = self.expression(module, value, hops + 1)
            if alias is not None:
                return alias
        if isinstance(value, ast.Call):
            made_by = self.expression(module, value.func, hops + 1)
            if made_by is not None and made_by.kind == "class":
                return _Found("instance", module, stmt, value, instance_of=made_by)
        return _Found("attribute", module, stmt, value)

    def _lazy_attribute(self, module: str, tree: ast.Module, name: str, hops: int) -> _Found | None:
        """A module ``__getattr__`` backed by a dict literal ``{"Name": ".sub.module:Name"}``."""
        if not any(isinstance(s, ast.FunctionDef) and s.name == "__getattr__" for s in _runtime_statements(tree.body)):
            return None
        for stmt in tree.body:
            value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
            if not isinstance(value, ast.Dict):
                continue
            for key, target in zip(value.keys, value.values):
                if (
                    isinstance(key, ast.Constant)
                    and key.value == name
                    and isinstance(target, ast.Constant)
                    and isinstance(target.value, str)
                    and ":" in target.value
                ):
                    source, _, attr = target.value.partition(":")
                    level = len(source) - len(source.lstrip("."))
                    return self._imported(self._absolute(module, level, source.lstrip(".") or source), attr, hops)
        return None

    def expression(self, module: str, expr: ast.expr, hops: int = 0) -> _Found | None:
        """What a name or dotted name written in ``module`` refers to."""
        if hops > _MAX_IMPORT_HOPS:
            return None
        if isinstance(expr, ast.Name):
            return self.module_member(module, expr.id, hops)
        if isinstance(expr, ast.Attribute):
            owner = self.expression(module, expr.value, hops + 1)
            return self.member(owner, expr.attr) if owner is not None else None
        if isinstance(expr, ast.Subscript):  # Generic[T], Protocol[...]
            return self.expression(module, expr.value, hops + 1)
        return None

    # -- classes --------------------------------------------------------------------------------

    def bases(self, cls: _Found) -> Iterator[_Found]:
        assert isinstance(cls.node, ast.ClassDef)
        for base in cls.node.bases:
            found = self.expression(cls.module, base)
            if found is not None and found.kind == "class":
                yield found

    def class_member(self, cls: _Found, name: str, seen: set[tuple[str, str]]) -> _Found | None:
        node = cls.node
        assert isinstance(node, ast.ClassDef)
        if (cls.module, node.name) in seen:
            return None
        seen.add((cls.module, node.name))
        for stmt in _runtime_statements(node.body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return _Found("attribute" if _is_property(stmt) else "method", cls.module, stmt)
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                return _Found("class", cls.module, stmt)
            if isinstance(stmt, ast.Assign) and any(name in _target_names(t) for t in stmt.targets):
                return _Found("attribute", cls.module, stmt, stmt.value)
            if isinstance(stmt, ast.AnnAssign) and name in _target_names(stmt.target):
                return _Found("attribute", cls.module, stmt, stmt.value)
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.args.args:
                owner = stmt.args.args[0].arg  # self (or cls)
                for inner in ast.walk(stmt):
                    targets = (
                        inner.targets
                        if isinstance(inner, ast.Assign)
                        else [inner.target]
                        if isinstance(inner, (ast.AnnAssign, ast.AugAssign))
                        else []
                    )
                    for target in targets:
                        for element in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                            if (
                                isinstance(element, ast.Attribute)
                                and element.attr == name
                                and isinstance(element.value, ast.Name)
                                and element.value.id == owner
                            ):
                                return _Found("attribute", cls.module, inner)
        for base in self.bases(cls):
            found = self.class_member(base, name, seen)
            if found is not None:
                return found
        return None

    def dataclass_fields(self, cls: _Found, seen: set[tuple[str, str]] | None = None) -> list[str]:
        """Annotated fields in dataclass order (bases first); ``ClassVar`` left out."""
        node = cls.node
        assert isinstance(node, ast.ClassDef)
        seen = seen if seen is not None else set()
        if (cls.module, node.name) in seen:
            return []
        seen.add((cls.module, node.name))
        fields: list[str] = []
        for base in reversed(list(self.bases(cls))):
            fields += [f for f in self.dataclass_fields(base, seen) if f not in fields]
        for stmt in node.body:
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and "ClassVar" not in ast.unparse(stmt.annotation)
                and stmt.target.id not in fields
            ):
                fields.append(stmt.target.id)
        return fields

    def derives_from(self, cls: _Found, module: str, name: str, seen: set[tuple[str, str]] | None = None) -> bool:
        seen = seen if seen is not None else set()
        assert isinstance(cls.node, ast.ClassDef)
        if (cls.module, cls.node.name) in seen:
            return False
        seen.add((cls.module, cls.node.name))
        for base in self.bases(cls):
            assert isinstance(base.node, ast.ClassDef)
            if (base.module, base.node.name) == (module, name) or self.derives_from(base, module, name, seen):
                return True
        return False


# ---- checking -----------------------------------------------------------------------------------

_ACCEPTED_KINDS = {
    "module": {"module"},
    "class": {"class"},
    "function": {"function"},
    "method": {"method"},
    "attribute": {"attribute", "instance"},
}


@dataclass(frozen=True)
class SymbolCheck:
    """``status``: ``ok``, ``missing`` or ``changed`` (found, but not as the engine uses it)."""

    symbol: VllmSymbol
    status: str
    detail: str = ""
    defined_in: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _check_one(resolver: _Resolver, symbol: VllmSymbol) -> SymbolCheck:
    found = resolver.lookup(symbol.module, symbol.qualname)
    if found is None:
        return SymbolCheck(symbol, "missing", "not found")
    where = found.module
    if found.kind == "external":
        return SymbolCheck(symbol, "ok", "re-exported from outside vLLM", where)
    if found.kind not in _ACCEPTED_KINDS[symbol.kind]:
        shown = "property or attribute" if found.kind == "attribute" else found.kind
        return SymbolCheck(symbol, "changed", f"is a {shown} now, the engine uses a {symbol.kind}", where)
    if symbol.params:
        if isinstance(found.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = found.node.args
            names = [a.arg for a in (*args.posonlyargs, *args.args)]
        elif isinstance(found.node, ast.ClassDef):
            names = resolver.dataclass_fields(found)
        else:
            names = []
        if tuple(names[: len(symbol.params)]) != symbol.params:
            return SymbolCheck(
                symbol,
                "changed",
                f"parameters are ({', '.join(names)}), the engine passes ({', '.join(symbol.params)})",
                where,
            )
    if symbol.subclass_of:
        base_module, _, base_name = symbol.subclass_of.partition(":")
        if not resolver.derives_from(found, base_module, base_name):
            return SymbolCheck(symbol, "changed", f"no longer derives from {base_module}.{base_name}", where)
    if symbol.decorator and isinstance(found.node, ast.ClassDef):
        decorators = [ast.unparse(d) for d in found.node.decorator_list]
        if symbol.decorator not in decorators:
            return SymbolCheck(
                symbol, "changed", f"decorators are {decorators or 'none'}, the engine needs @{symbol.decorator}", where
            )
    return SymbolCheck(symbol, "ok", "", where)


def check_symbols(tree: SourceTree, symbols: tuple[VllmSymbol, ...] = ENGINE_SYMBOLS) -> list[SymbolCheck]:
    """One result per symbol, in table order."""
    resolver = _Resolver(tree)
    return [_check_one(resolver, symbol) for symbol in symbols]


# ---- fetching a release -------------------------------------------------------------------------


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "my_pkg" / "vllm-wheels"


def fetch_wheel(version: str, cache_dir: Path) -> Path:
    """The vLLM ``version`` wheel from ``cache_dir``, downloaded there first when missing (no dependencies)."""
    cached = sorted(cache_dir.glob(f"vllm-{version}-*.whl"))
    if cached:
        return cached[0]
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as staging:  # a partial download never looks cached
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"vllm=={version}",
            "--no-deps",
            "--only-binary=:all:",
            "--quiet",
            "-d",
            staging,
        ]
        print(f"downloading the vLLM {version} wheel (no dependencies) into {cache_dir} ...", flush=True)
        proc = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(Path(staging).glob(f"vllm-{version}-*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise CompatError(f"`{' '.join(command[2:])}` failed: {' / '.join(tail) or 'no wheel for this platform'}")
        target = cache_dir / wheels[0].name
        shutil.move(str(wheels[0]), target)
    return target


# ---- command line -------------------------------------------------------------------------------


def format_table(results: list[SymbolCheck]) -> str:
    header = ("status", "module", "name", "kind", "used by")
    rows = [
        (
            r.status.upper() if not r.ok else "ok",
            r.symbol.module,
            r.symbol.qualname or "(module)",
            r.symbol.kind,
            r.symbol.used_by,
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in (header, *rows)]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m my_pkg.devtools.compat",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = ap.add_mutually_exclusive_group()
    source.add_argument(
        "--vllm-version", default=None, help=f"release to fetch and check (default {DEFAULT_VLLM_VERSION})"
    )
    source.add_argument("--wheel", type=Path, default=None, help="check this vLLM wheel file")
    source.add_argument("--installed", action="store_true", help="check the vLLM installed in this environment")
    ap.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where fetched wheels are kept and reused (default: ~/.cache/my_pkg/vllm-wheels)",
    )
    args = ap.parse_args(argv)
    try:
        if args.installed:
            tree = SourceTree.installed()
        elif args.wheel is not None:
            tree = SourceTree.from_wheel(args.wheel)
        else:
            version = args.vllm_version or DEFAULT_VLLM_VERSION
            tree = SourceTree.from_wheel(fetch_wheel(version, args.cache_dir or default_cache_dir()))
        if tree.module("vllm") is None:
            raise CompatError(f"{tree.origin} holds no vllm package")
    except CompatError as exc:
        print(f"compat: {exc}", file=sys.stderr)
        return EXIT_NO_SOURCES
    results = check_symbols(tree)
    print(f"vLLM {tree.version() or '(unknown version)'} from {tree.origin}\n")
    print(format_table(results))
    bad = [r for r in results if not r.ok]
    print(f"\n{len(results) - len(bad)} of {len(results)} engine symbols found as used.")
    if bad:
        print(f"{len(bad)} missing or changed:")
        for r in bad:
            print(
                f"  {r.status}: {r.symbol.name} ({r.symbol.kind}, used by {r.symbol.used_by}): {r.detail}"
                + (f" [looked in {r.defined_in}]" if r.defined_in else "")
            )
        return EXIT_MISSING
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
