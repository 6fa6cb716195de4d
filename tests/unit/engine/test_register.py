"""register(): idempotent, lazy, kill switch, and harmless when a vLLM internal moved.

Each case runs in a fresh interpreter, because register() changes vLLM classes
for the life of a process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import json, sys
    {prelude}
    import my_pkg.engine
    lazy = "vllm" not in sys.modules and "torch" not in sys.modules
    my_pkg.engine.register()
    my_pkg.engine.register()
    from vllm import ModelRegistry
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.v1.worker.worker_base import WorkerBase
    after_register = getattr(op_registry_oot.get("LogitsProcessor"), "__name__", None)
    {then}
    print(json.dumps({{
        "lazy_import": lazy,
        "methods": sorted(m for m in vars(WorkerBase) if m.startswith("my_pkg_")),
        "flashhead_archs": sorted(a for a in ModelRegistry.get_supported_archs() if a.startswith("FlashHead")),
        "logits_processor_after_register": after_register,
        "logits_processor": getattr(op_registry_oot.get("LogitsProcessor"), "__name__", None),
        **extra,
    }}))
    """
)


# What vLLM does right before it builds a FlashHead model: resolve its architecture.
RESOLVE_FLASHHEAD = textwrap.dedent(
    """
    from vllm.config import VllmConfig, set_current_vllm_config
    with set_current_vllm_config(VllmConfig()):  # as in the worker, which builds the model
        model_cls = ModelRegistry.models["FlashHeadLlamaForCausalLM"].load_model_cls()
    from my_pkg.engine import patches
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    extra = {"model_cls": model_cls.__name__,
             "hook_errors": {n: patches.hook_error(n) for n in patches.FLASHHEAD_HOOKS},
             "no_controller": patches.no_controller_status().model_dump(include={"reason_code", "reason"}),
             "runner_hooked": getattr(GPUModelRunner.execute_model, "_my_pkg_wrapped", False),
             "drafter_hooked": getattr(SpecDecodeBaseProposer._greedy_sample, "_my_pkg_wrapped", False)}
    """
)


def _probe(prelude: str = "", then: str = "extra = {}", **env: str) -> tuple[dict, str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MY_PKG_")}
    environment.update(env)
    code = PROBE.format(prelude=prelude, then=then.strip())
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.slow
def test_register_applies_every_patch_once_and_imports_lazily():
    result, _ = _probe(then=RESOLVE_FLASHHEAD)
    assert result["lazy_import"] is True
    from my_pkg.contract import WORKER_METHOD_NAMES

    assert result["methods"] == sorted(WORKER_METHOD_NAMES)
    for arch in (
        "FlashHeadLlamaForCausalLM",
        "FlashHeadQwen2ForCausalLM",
        "FlashHeadQwen3ForCausalLM",
        "FlashHeadMistralForCausalLM",
        "FlashHeadGemma3ForCausalLM",
    ):
        assert arch in result["flashhead_archs"]
    # vLLM's LogitsProcessor is replaced only once a FlashHead model is about to be built.
    assert result["logits_processor_after_register"] is None
    assert result["model_cls"] == "LlamaForCausalLM"
    assert result["logits_processor"] == "FlashHeadLogitsProcessor"
    # One entry installed every FlashHead hook, when the architecture was resolved.
    assert result["hook_errors"] == {
        "logits_processor": None,
        "model_loader": None,
        "model_runner": None,
        "compact_sampler": None,
        "model_runner_v2": None,
        "spec_proposer": None,
    }
    assert result["runner_hooked"] is True and result["drafter_hooked"] is True
    assert result["no_controller"]["reason_code"] == "no_assets"


@pytest.mark.slow
def test_installing_the_plugin_leaves_another_plugins_logits_processor_working():
    """A second general plugin that replaces LogitsProcessor, loaded after ours, in the same
    process: vLLM does not catch its assertion on a duplicate, so our registration must not
    be there yet. Building a FlashHead model then leaves it in place and says why."""
    other = textwrap.dedent(
        """
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        class OtherPluginLogitsProcessor(LogitsProcessor):
            pass
        LogitsProcessor.register_oot(OtherPluginLogitsProcessor)
        """
    )
    result, stderr = _probe(then=other + RESOLVE_FLASHHEAD)
    assert result["logits_processor"] == "OtherPluginLogitsProcessor"
    assert result["model_cls"] == "LlamaForCausalLM"
    assert "OtherPluginLogitsProcessor" in result["hook_errors"]["logits_processor"]
    assert result["no_controller"]["reason_code"] == "logits_processor_taken"
    assert "OtherPluginLogitsProcessor" in result["no_controller"]["reason"]
    assert stderr.count("FlashHead cannot hook vLLM's logits") == 1


@pytest.mark.slow
def test_disable_leaves_vllm_untouched():
    result, _ = _probe(MY_PKG_DISABLE="1")
    assert result["methods"] == []
    assert result["flashhead_archs"] == []
    assert result["logits_processor"] is None


@pytest.mark.slow
def test_moved_internal_warns_once_and_leaves_that_component_alone():
    # The worker patch cannot find WorkerBase: it must warn, not raise, and the other
    # patches still apply. (The probe re-imports WorkerBase afterwards, so restore it.)
    prelude = textwrap.dedent(
        """
        import vllm.v1.worker.worker_base as wb
        saved = wb.WorkerBase
        del wb.WorkerBase
        import my_pkg.engine
        my_pkg.engine.register()
        wb.WorkerBase = saved
        """
    )
    result, stderr = _probe(prelude)
    assert result["methods"] == []  # the worker patch did not apply
    assert "FlashHeadLlamaForCausalLM" in result["flashhead_archs"]  # the registry patch did
    assert stderr.count("vllm.v1.worker.worker_base.WorkerBase") == 1


@pytest.mark.slow
def test_vllms_model_inspection_subprocess_can_load_a_flashhead_entry():
    """vLLM inspects an uncached architecture in a subprocess, pickling the registry entry."""
    then = textwrap.dedent(
        """
        from vllm.model_executor.models.registry import _ModelInfo, _run_in_subprocess
        entry = ModelRegistry.models["FlashHeadLlamaForCausalLM"]
        info = _run_in_subprocess(lambda: _ModelInfo.from_model_cls(entry.load_model_cls()))
        extra = {"entry": type(entry).__name__, "inspected": type(info).__name__}
        """
    )
    result, _ = _probe(then=then)
    assert result["entry"] == "FlashHeadRegisteredModel" and result["inspected"] == "_ModelInfo"
