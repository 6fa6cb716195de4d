"""my_pkg.devtools.compat.manifest: the manifest comes from the engine modules' imports and declarations."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from my_pkg.devtools.compat import (
    ENGINE_DIR,
    ENGINE_SYMBOLS,
    KINDS,
    VllmSymbol,
    declared_symbols,
    derived_symbols,
    engine_symbols,
    unused_declarations,
)

from .conftest import ROOT

ENGINE = ROOT / "my_pkg" / "engine"
TABLE = {(symbol.module, symbol.qualname) for symbol in ENGINE_SYMBOLS}

#: The hand-written table the compat check kept before the manifest was derived: `module: qualname ...`
#: (`(module)`: the module itself), and the constraints its entries pinned. Every one the engine still uses is
#: checked.
OLD_HAND_TABLE = """
vllm: (module) __version__ ModelRegistry ModelRegistry.models
vllm.v1.worker.worker_base: WorkerBase WorkerBase.rank WorkerBase.local_rank WorkerBase.device WorkerBase.model_runner
    WorkerBase.model_config WorkerBase.cache_config WorkerBase.parallel_config WorkerBase.scheduler_config
vllm.v1.worker.gpu_model_runner: GPUModelRunner.kv_caches GPUModelRunner GPUModelRunner.execute_model
    GPUModelRunner.get_model GPUModelRunner.load_model GPUModelRunner.input_batch GPUModelRunner.model
    GPUModelRunner.model_config GPUModelRunner._calc_spec_decode_metadata GPUModelRunner.speculative_config
vllm.config: ParallelConfig.world_size ModelConfig.model ModelConfig.dtype ModelConfig.served_model_name
    ModelConfig.max_model_len ModelConfig.revision ModelConfig.hf_config ModelConfig.head_dtype CacheConfig.block_size
    CacheConfig.num_gpu_blocks get_current_vllm_config VllmConfig.model_config VllmConfig.parallel_config
    VllmConfig.speculative_config VllmConfig.lora_config VllmConfig.use_v2_model_runner get_current_vllm_config_or_none
    ParallelConfig.pipeline_parallel_size ModelConfig.enable_sleep_mode SpeculativeConfig.method
    SpeculativeConfig.num_speculative_tokens
vllm.model_executor.models.registry: _LazyRegisteredModel _LazyRegisteredModel.module_name
    _LazyRegisteredModel.class_name _LazyRegisteredModel.load_model_cls
vllm.model_executor.custom_op: op_registry_oot
vllm.model_executor.layers.logits_processor: LogitsProcessor LogitsProcessor.forward LogitsProcessor.register_oot
    LogitsProcessor.logits_as_input LogitsProcessor.org_vocab_size LogitsProcessor.soft_cap LogitsProcessor.scale
vllm.lora.layers.logits_processor: LogitsProcessorWithLoRA.base_layer
vllm.model_executor.layers.vocab_parallel_embedding: VocabParallelEmbedding.quant_method UnquantizedEmbeddingMethod
    VocabParallelEmbedding ParallelLMHead
vllm.model_executor.layers.linear: UnquantizedLinearMethod
vllm.v1.worker.gpu_input_batch: InputBatch InputBatch.add_request InputBatch.remove_request InputBatch.num_reqs
    InputBatch.req_id_to_index InputBatch.temperature_cpu InputBatch.logitsprocs CachedRequestState.req_id
    CachedRequestState.sampling_params
vllm.v1.sample.logits_processor.state: LogitsProcessors.all
vllm.v1.sample.logits_processor.builtin: MinPLogitsProcessor LogitBiasLogitsProcessor MinTokensLogitsProcessor
vllm.v1.worker.cpu_model_runner: CPUModelRunner CPUModelRunner.load_model
vllm.compilation.backends: (module) model_tag
vllm.v1.worker.gpu.model_runner: GPUModelRunner GPUModelRunner.sample GPUModelRunner.load_model GPUModelRunner.get_model
    GPUModelRunner.sampler GPUModelRunner.batch_sharder
vllm.v1.worker.gpu.sample.sampler: Sampler Sampler.add_request Sampler.sampling_states Sampler.logits_processors
vllm.v1.worker.gpu.sample.states: SamplingStates.max_num_reqs SamplingStates.temperature
vllm.v1.worker.gpu.buffer_utils: UvaBackedTensor.np
vllm.v1.worker.gpu.input_batch: InputBatch.num_reqs InputBatch.idx_mapping_np InputBatch.cu_num_logits_np
vllm.v1.worker.gpu.sample.logit_bias: LogitBiasState
vllm.v1.worker.gpu.sample.penalties: PenaltiesState
vllm.v1.worker.gpu.sample.bad_words: BadWordsState
vllm.sampling_params: SamplingParams.logprobs SamplingParams.logprob_token_ids SamplingParams.structured_outputs
    SamplingParams.logit_bias SamplingParams.allowed_token_ids SamplingParams.bad_words
    SamplingParams.thinking_token_budget SamplingParams.watermarking SamplingParams.extra_args
    SamplingParams.stop_token_ids SamplingParams.all_stop_token_ids SamplingParams.temperature
    SamplingParams.presence_penalty SamplingParams.frequency_penalty SamplingParams.repetition_penalty
vllm.tokenizers.registry: cached_tokenizer_from_config
"""
_REGISTRY, _V1, _V2 = (
    "vllm.model_executor.models.registry",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.model_runner",
)
_VOCAB = "vllm.model_executor.layers.vocab_parallel_embedding"
OLD_CONSTRAINTS = {  # (module, qualname): (params, subclass_of, decorator)
    (_REGISTRY, "_LazyRegisteredModel"): (("module_name", "class_name"), "", "dataclass(frozen=True)"),
    (_REGISTRY, "_LazyRegisteredModel.load_model_cls"): (("self",), "", ""),
    ("vllm.model_executor.layers.logits_processor", "LogitsProcessor.forward"): (
        ("self", "lm_head", "hidden_states", "embedding_bias", "skip_gather"),
        "",
        "",
    ),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.add_request"): (("self", "request"), "", ""),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.remove_request"): (("self", "req_id"), "", ""),
    (_V1, "GPUModelRunner.execute_model"): (("self",), "", ""),
    (_V1, "GPUModelRunner.get_model"): (("self",), "", ""),
    (_V1, "GPUModelRunner.load_model"): (("self",), "", ""),
    (_V1, "GPUModelRunner._calc_spec_decode_metadata"): (
        ("self", "num_draft_tokens", "cu_num_scheduled_tokens"),
        "",
        "",
    ),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"): ((), f"{_V1}:GPUModelRunner", ""),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner.load_model"): (("self",), "", ""),
    (_VOCAB, "ParallelLMHead"): ((), f"{_VOCAB}:VocabParallelEmbedding", ""),
    (_V2, "GPUModelRunner.sample"): (("self", "hidden_states", "input_batch"), "", ""),
    (_V2, "GPUModelRunner.load_model"): (("self",), "", ""),
    (_V2, "GPUModelRunner.get_model"): (("self",), "", ""),
    ("vllm.v1.worker.gpu.sample.sampler", "Sampler.add_request"): (("self", "req_idx", "sampling_params"), "", ""),
    ("vllm.tokenizers.registry", "cached_tokenizer_from_config"): (("model_config",), "", ""),
}
#: Entries declared since, beyond the old table, each with its reason (new imports are derived as they come).
ADDED_SINCE_THE_HAND_TABLE: dict[tuple[str, str], str] = {
    (_V2, "GPUModelRunner.speculative_config"): "model_runner_v2.runner_step_rows reads it, as V1's does",
    ("vllm.model_executor.layers.logits_processor", "LogitsProcessor._get_logits"): "the sharded step's dense rows",
    ("vllm.model_executor.layers.logits_processor", "LogitsProcessor._gather_logits"): "the sharded step's gather",
    (_VOCAB, "VocabParallelEmbedding.tp_size"): "build_head and forward tell a sharded head apart",
    (_VOCAB, "VocabParallelEmbedding.shard_indices"): "a rank's vocabulary shard",
    (_VOCAB, "VocabParallelEmbeddingShardIndices.org_vocab_start_index"): "the shard's first id",
    (_VOCAB, "VocabParallelEmbeddingShardIndices.org_vocab_end_index"): "the shard's end",
    (_VOCAB, "VocabParallelEmbeddingShardIndices.num_org_elements"): "the shard's width without padding",
}


def _old_table() -> set[tuple[str, str]]:
    names, module = set(), None
    for line in OLD_HAND_TABLE.strip().splitlines():
        if not line.startswith(" "):
            module, _, line = line.partition(":")
        assert module is not None
        names |= {(module, "" if word == "(module)" else word) for word in line.split()}
    return names


def _engine_files() -> list[Path]:
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) >= 8, files  # the engine half, patches included
    return files


def _write_engine(root: Path, modules: dict[str, str]) -> Path:
    engine = root / "engine"
    for name, source in modules.items():
        (engine / name).parent.mkdir(parents=True, exist_ok=True)
        (engine / name).write_text(textwrap.dedent(source))
    return engine


# ---- derivation -----------------------------------------------------------------------------------

SYNTHETIC = """
import importlib
import vllm
import vllm.compilation.backends as backends

TARGET = "vllm.v1.worker.worker_base.WorkerBase, vllm.ModelRegistry"

def apply():
    from vllm.config import get_current_vllm_config, VllmConfig as Config
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.v1.worker.gpu_input_batch import InputBatch

    config = get_current_vllm_config()
    require((InputBatch, "add_request"), (InputBatch, 3))
    original = InputBatch.remove_request
    InputBatch.num_reqs = 3  # a write: nothing vLLM must have
    op_registry_oot.get(InputBatch.__name__)
    version = getattr(vllm, "__version__", None)
    tag = getattr(backends, "model_tag", "backbone")
    backends.compile_fx(config)
    importlib.import_module("vllm.v1.worker.cpu_model_runner")
    return isinstance(config, Config)
"""


def test_derivation_reads_imports_in_any_scope_targets_and_reads_on_imported_names():
    derived = {(s.module, s.qualname): s.kind for s in derived_symbols(SYNTHETIC, "engine/x.py")}
    assert derived == {
        ("vllm", ""): "module",
        ("vllm.compilation.backends", ""): "module",
        ("vllm.v1.worker.worker_base", "WorkerBase"): "class",
        ("vllm", "ModelRegistry"): "class",  # as a TARGET string reads; model_registry.py declares it an attribute
        ("vllm.config", "get_current_vllm_config"): "function",  # called
        ("vllm.config", "VllmConfig"): "class",  # imported as another name
        ("vllm.model_executor.custom_op", "op_registry_oot"): "attribute",  # its .get is a dict's
        ("vllm.v1.worker.gpu_input_batch", "InputBatch"): "class",
        ("vllm.v1.worker.gpu_input_batch", "InputBatch.add_request"): "method",  # a (class, "name") pair
        ("vllm.v1.worker.gpu_input_batch", "InputBatch.remove_request"): "attribute",  # read, not called
        ("vllm", "__version__"): "attribute",
        ("vllm.compilation.backends", "model_tag"): "attribute",
        ("vllm.compilation.backends", "compile_fx"): "function",
        ("vllm.v1.worker.cpu_model_runner", ""): "module",
    }
    assert {s.used_by for s in derived_symbols(SYNTHETIC, "engine/x.py")} == {"engine/x.py"}


def test_the_real_tree_derives_its_imports_function_local_ones_included():
    derived = {(s.module, s.qualname, s.kind) for s in derived_symbols((ENGINE / "patches/worker.py").read_text(), "w")}
    assert derived == {("vllm.v1.worker.worker_base", "WorkerBase", "class")}  # imported inside apply()
    by_name = {(s.module, s.qualname): s for s in ENGINE_SYMBOLS}
    assert by_name[("vllm", "__version__")].used_by == "engine/rpc.py"  # getattr(vllm, "__version__")
    assert by_name[("vllm.v1.worker.gpu_input_batch", "InputBatch.add_request")].kind == "method"
    assert by_name[("vllm.model_executor.custom_op", "op_registry_oot")].kind == "attribute"


def test_declarations_override_derived_kinds_and_merge_across_modules(tmp_path):
    engine = _write_engine(
        tmp_path,
        {
            "a.py": """
                from my_pkg.engine.vllm_uses import attributes, symbol

                VLLM_SYMBOLS = (
                    symbol("vllm:Registry", "attribute"),
                    symbol("vllm.m:Entry", "class", params=("module_name",)),
                    *attributes("vllm.config:ModelConfig", "dtype"),
                )

                def apply():
                    from vllm import Registry
                    from vllm.m import Entry
                    return Entry(Registry.models), config.dtype
            """,
            "sub/b.py": """
                from vllm.m import Entry
                from my_pkg.engine.vllm_uses import attributes, symbol

                VLLM_SYMBOLS = (symbol("vllm.m:Entry", "class", decorator="dataclass(frozen=True)"),)
            """,
        },
    )
    symbols = {(s.module, s.qualname): s for s in engine_symbols(engine)}
    assert symbols[("vllm", "Registry")] == VllmSymbol("vllm", "Registry", "attribute", "engine/a.py")
    assert symbols[("vllm.m", "Entry")] == VllmSymbol(
        "vllm.m", "Entry", "class", "engine/a.py, engine/sub/b.py", ("module_name",), "", "dataclass(frozen=True)"
    )
    assert set(symbols) == {
        ("vllm", "Registry"),
        ("vllm", "Registry.models"),
        ("vllm.m", "Entry"),
        ("vllm.config", "ModelConfig.dtype"),
    }


@pytest.mark.parametrize(
    ("declaration", "message"),
    [
        ('VLLM_SYMBOLS = (symbol(TARGET, "class"),)', "literal"),  # not a literal
        ('VLLM_SYMBOLS = (attributes("vllm.config:ModelConfig", "dtype"),)', "attributes"),  # not starred
        ('VLLM_SYMBOLS = (Declared("vllm", "x", "attribute"),)', r"found Declared\("),  # not a helper
        ('VLLM_SYMBOLS = (symbol("vllm.config:ModelConfig", "klass"),)', "kind"),
        ('VLLM_SYMBOLS = (symbol("torch:Tensor", "class"),)', "vLLM target"),
        ('VLLM_SYMBOLS = [symbol("vllm.config:ModelConfig", "class")]', "tuple"),
    ],
)
def test_malformed_declarations_are_refused(declaration, message):
    with pytest.raises(ValueError, match=message):
        declared_symbols(declaration, "engine/x.py")


def test_conflicting_declarations_are_refused(tmp_path):
    engine = _write_engine(
        tmp_path,
        {
            "a.py": 'VLLM_SYMBOLS = (symbol("vllm.m:Entry.load", "method", params=("self",)),)\n',
            "b.py": 'VLLM_SYMBOLS = (symbol("vllm.m:Entry.load", "method", params=("self", "x")),)\n',
        },
    )
    with pytest.raises(ValueError, match="params"):
        engine_symbols(engine)
    (engine / "b.py").write_text('VLLM_SYMBOLS = (symbol("vllm.m:Entry.load", "attribute"),)\n')
    with pytest.raises(ValueError, match="declared a method by engine/a.py and a attribute"):
        engine_symbols(engine)


# ---- unused entries ---------------------------------------------------------------------------------


def test_an_unused_declaration_is_reported():
    source = textwrap.dedent(
        """
        from my_pkg.engine.vllm_uses import attributes, symbol

        VLLM_SYMBOLS = (
            *attributes("vllm.config:ModelConfig", "dtype", "revision", "model_config", "gone", "scheduler_config"),
            symbol("vllm.a:Cls.hook", "method"),
            symbol("vllm.a:Named", "class"),
            symbol("vllm.a:Named.local", "attribute"),
            symbol("vllm.compilation.backends", "module"),
            symbol("vllm.never.imported", "module"),
        )

        def f(config, section, local):
            import vllm.compilation.backends as backends

            getattr(config, "revision", None), config.dtype, getattr(config, f"{section}_config")
            return (Named, "hook"), "dtype: gone"  # a word inside a longer string does not count
        """
    )
    assert unused_declarations(source, "engine/x.py") == [
        "vllm.config.ModelConfig.gone",
        "vllm.a.Named.local",  # a variable of that name is no attribute read
        "vllm.never.imported",
    ]


def test_no_engine_module_declares_a_name_its_code_does_not_use():
    unused = {}
    for path in _engine_files():
        found = unused_declarations(path.read_text(), path.name)
        if found:
            unused[str(path.relative_to(ROOT))] = found
    assert unused == {}


def test_engine_modules_never_import_devtools():
    for path in _engine_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any(name.startswith("my_pkg.devtools") for name in names), path


# ---- the manifest of the real tree ------------------------------------------------------------------


def test_the_manifest_checks_every_symbol_of_the_old_hand_table():
    old = _old_table()
    assert len(old) == 114  # two fewer since speculative verify rows stopped scoring their draft token
    assert sorted(old - TABLE) == []
    assert sorted(set(ADDED_SINCE_THE_HAND_TABLE) - TABLE) == []  # a new import is derived: no list to update
    by_name = {(s.module, s.qualname): s for s in ENGINE_SYMBOLS}
    for key, (params, subclass_of, decorator) in OLD_CONSTRAINTS.items():
        symbol = by_name[key]
        assert (symbol.params, symbol.subclass_of, symbol.decorator) == (params, subclass_of, decorator), key
        assert symbol.kind != "attribute" or not params, key


def test_request_fields_that_decide_dense_rows_are_in_the_table():
    from my_pkg.engine.flashhead.rows import DENSE_REQUEST_FIELDS

    fields = {q.split(".", 1)[1] for m, q in TABLE if m == "vllm.sampling_params" and q.startswith("SamplingParams.")}
    assert set(DENSE_REQUEST_FIELDS) <= fields, set(DENSE_REQUEST_FIELDS) - fields


def test_table_entries_are_well_formed_and_unique():
    assert ENGINE_DIR == ENGINE
    assert len(TABLE) == len(ENGINE_SYMBOLS)
    for symbol in ENGINE_SYMBOLS:
        assert symbol.kind in KINDS and symbol.module.split(".")[0] == "vllm", symbol
        files = [ROOT / "my_pkg" / path.strip() for path in symbol.used_by.split(",")]
        assert symbol.used_by and all(file.is_file() for file in files), symbol
