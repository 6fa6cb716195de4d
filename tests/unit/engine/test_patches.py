"""The vLLM glue: which requests need dense rows, the step rows, and the logits processor."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from my_pkg.engine import setup as engine_setup
from my_pkg.engine.flashhead import FlashHeadController, StepRows
from my_pkg.engine.flashhead.rows import DenseReason, request_dense_reason, request_stop_ids
from my_pkg.engine.patches import logits_processor, model_runner
from tests.support.vllm_fakes import UnquantizedEmbeddingMethod, default_vllm_config

VOCAB, HIDDEN, CAP = 256, 16, 16


def _reason(sampling_params) -> str | None:
    """The label of the request's dense reason (its counter key), None when FlashHead may serve it."""
    reason = request_dense_reason(sampling_params)
    return None if reason is None else reason.label


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({}, None),
        ({"temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.2, "seed": 3}, None),
        ({"logprobs": 2}, "logprobs"),
        ({"prompt_logprobs": 1}, None),  # the prompt's logits call is dense anyway; decode may use FlashHead
        ({"logit_bias": {5: 2.0}}, "logit_bias"),
        ({"allowed_token_ids": [1, 2, 3]}, "allowed_token_ids"),
        ({"bad_words": ["the"]}, "bad_words"),
    ],
)
def test_request_dense_reason_from_real_sampling_params(kwargs, reason):
    from vllm import SamplingParams

    assert _reason(SamplingParams(**kwargs)) == reason


def test_every_sampling_params_field_is_classified():
    """Fails when vLLM adds a request field: decide whether FlashHead may serve it, then list it."""
    from vllm import SamplingParams

    from my_pkg.engine.flashhead.rows import DENSE_REQUEST_FIELDS, FLASHHEAD_REQUEST_FIELDS

    public = {name for name in SamplingParams.__struct_fields__ if not name.startswith("_")}
    unknown = public - set(DENSE_REQUEST_FIELDS) - FLASHHEAD_REQUEST_FIELDS
    assert not unknown, f"classify these SamplingParams fields: {sorted(unknown)}"
    assert set(DENSE_REQUEST_FIELDS) <= public and FLASHHEAD_REQUEST_FIELDS <= public


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"logprob_token_ids": [5, 9]}, "logprobs"),
        ({"logprobs": 0}, "logprobs"),
        ({"prompt_logprobs": 0, "prompt_logprob_token_ids": [3]}, None),
        ({"thinking_token_budget": 8}, "thinking_budget"),
        ({"extra_args": {"flashhead": False}}, "opt_out"),
        ({"extra_args": {"flashhead": 0}}, "opt_out"),  # what `"vllm_xargs": {"flashhead": false}` becomes
        ({"extra_args": {"flashhead": "false"}}, "opt_out"),
        ({"extra_args": {"flashhead": True, "other": 1}}, None),
        ({"stop_token_ids": [3], "min_tokens": 2, "n": 3, "top_k": 5, "min_p": 0.1}, None),
        ({"temperature": 0.0, "repetition_penalty": 1.1}, "penalized_greedy"),
        ({"temperature": 0.0, "presence_penalty": 0.5}, "penalized_greedy"),
        ({"temperature": 0.0, "frequency_penalty": -0.2}, "penalized_greedy"),
        ({"temperature": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0}, None),
        ({"temperature": 0.7, "frequency_penalty": 0.5, "repetition_penalty": 1.3}, None),  # sampled: served
    ],
)
def test_more_request_fields(kwargs, reason):
    from vllm import SamplingParams

    assert _reason(SamplingParams(**kwargs)) == reason


def test_a_field_this_plugin_does_not_know_is_served_dense_when_set():
    from vllm import SamplingParams

    class NewerSamplingParams(SamplingParams, kw_only=True):
        future_logits_feature: int = 0

    assert request_dense_reason(NewerSamplingParams()) is None
    assert request_dense_reason(NewerSamplingParams(future_logits_feature=2)) is DenseReason.UNCLASSIFIED


def test_structured_output_requests_need_dense_rows():
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    assert request_dense_reason(params) is DenseReason.STRUCTURED_OUTPUT


def _input_batch(num_reqs: int, temperatures, dense: dict[str, int], processors=()):
    batch = SimpleNamespace(
        num_reqs=num_reqs,
        req_id_to_index={f"r{i}": i for i in range(num_reqs + 2)},
        temperature_cpu=np.asarray(temperatures, dtype=np.float32),
        logitsprocs=SimpleNamespace(all=list(processors)),
    )
    batch.__dict__["_my_pkg_dense_requests"] = dense
    return batch


def test_step_rows_marks_only_the_tracked_requests():
    batch = _input_batch(3, [0.0, 0.7, 0.0, 1.0, 1.0], {"r1": DenseReason.LOGPROBS, "r4": DenseReason.BAD_WORDS})
    rows = model_runner.step_rows(batch)
    assert rows.dense_codes.tolist() == [0, DenseReason.LOGPROBS, 0]  # r4 is not in this step
    assert rows.sampled.tolist() == [False, True, False]


def test_step_rows_carry_the_stop_token_ids_of_the_steps_requests():
    batch = _input_batch(2, [0.0, 0.0], {})
    batch.__dict__["_my_pkg_stop_token_ids"] = {"r0": (9, 4), "r1": (4,), "r3": (77,)}  # r3 is not in the step
    assert model_runner.step_rows(batch).stop_ids == (4, 9)


def test_seeded_rows_are_sampled_rows():  # FlashHead's logits are deterministic: the seed still reproduces
    batch = _input_batch(3, [0.9, 0.9, 0.0], {})
    batch.generators = {0: object(), 7: object()}
    assert model_runner.step_rows(batch).sampled.tolist() == [True, True, False]


def test_step_rows_with_custom_logits_processors_is_all_dense():
    class MyProcessor:
        pass

    rows = model_runner.step_rows(_input_batch(2, [0.0, 0.0], {}, [MyProcessor()]))
    assert rows.dense_codes.tolist() == [DenseReason.CUSTOM_LOGITS_PROCESSORS] * 2


@pytest.fixture(autouse=True)
def vllm_config():
    with default_vllm_config():
        yield


@pytest.fixture
def processor_and_head():
    torch.manual_seed(0)
    weight = torch.randn(VOCAB + 16, HIDDEN)
    lm_head = SimpleNamespace(weight=weight, quant_method=UnquantizedEmbeddingMethod(), tp_size=1)
    processor = logits_processor.subclass()(VOCAB)
    assignments = torch.randperm(VOCAB) % (VOCAB // CAP)
    centroids = torch.stack([weight[:VOCAB][assignments == c].mean(0) for c in range(VOCAB // CAP)])
    processor._my_pkg_flashhead = FlashHeadController(
        centroids=centroids,
        assignments=assignments,
        config={"n_probes": 2},
        vocab_size=VOCAB,
    )
    return processor, lm_head


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_the_head_is_timed_beside_vllms_product_unless_vllm_is_batch_invariant(monkeypatch, batch_invariant):
    monkeypatch.delenv("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", raising=False)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1" if batch_invariant else "0")
    torch.manual_seed(0)
    weight = torch.randn(VOCAB + 16, HIDDEN)
    products: list[int] = []

    class CountingMethod(UnquantizedEmbeddingMethod):
        def apply(self, layer, x, bias=None):
            products.append(x.shape[0])
            return super().apply(layer, x, bias)

    CountingMethod.__name__ = "UnquantizedEmbeddingMethod"
    lm_head = SimpleNamespace(weight=weight, quant_method=CountingMethod(), tp_size=1)
    assignments = torch.randperm(VOCAB) % (VOCAB // CAP)
    centroids = torch.stack([weight[:VOCAB][assignments == c].mean(0) for c in range(VOCAB // CAP)])
    controller = FlashHeadController(
        centroids=centroids, assignments=assignments, config={"n_probes": 2}, vocab_size=VOCAB
    )
    engine_setup.build_head(controller, lm_head)
    assert controller.head is not None
    if batch_invariant:  # the operator asked for output independent of the batch: no step switches head
        assert controller.step_costs is None and products == []
    else:  # timed through the head's own quant method, as vLLM's logits processor computes it
        assert controller.step_costs is not None
        assert set(products) == set(controller.step_costs.batches)


def _arm(controller, num_rows):
    rows = StepRows(np.zeros(num_rows, np.uint8), np.zeros(num_rows, bool))
    controller.arm(lambda: rows)


def test_processor_without_controller_is_vllms_own():
    processor = logits_processor.subclass()(VOCAB)
    assert processor._my_pkg_flashhead is None  # no FlashHead assets in the current config
    weight = torch.randn(VOCAB + 16, HIDDEN)
    lm_head = SimpleNamespace(weight=weight, quant_method=UnquantizedEmbeddingMethod(), tp_size=1)
    hidden = torch.randn(2, HIDDEN)
    torch.testing.assert_close(processor(lm_head, hidden), hidden @ weight[:VOCAB].T)


def test_unarmed_calls_are_dense_and_armed_decode_steps_use_flashhead(processor_and_head):
    processor, lm_head = processor_and_head
    controller = processor._my_pkg_flashhead
    hidden = torch.randn(2, HIDDEN)
    dense = hidden @ lm_head.weight[:VOCAB].T
    torch.testing.assert_close(processor(lm_head, hidden), dense)
    assert controller.counters.steps == 0

    _arm(controller, 2)
    sparse = processor(lm_head, hidden)
    assert sparse.shape == (2, VOCAB)
    finite = torch.isfinite(sparse)
    assert 0 < finite.sum() <= 2 * 2 * CAP
    torch.testing.assert_close(sparse[finite], dense[finite])
    assert controller.counters.rows_flashhead == 2
    # The arming is consumed by one call: the next one (e.g. prompt logprobs) is dense.
    torch.testing.assert_close(processor(lm_head, hidden), dense)


def test_a_failing_head_falls_back_to_dense_and_counts(processor_and_head, monkeypatch):
    processor, lm_head = processor_and_head
    controller = processor._my_pkg_flashhead
    hidden = torch.randn(3, HIDDEN)
    _arm(controller, 3)
    processor(lm_head, hidden)  # builds the head

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(controller.head, "step_logits", broken)
    _arm(controller, 3)
    out = processor(lm_head, hidden)
    torch.testing.assert_close(out, hidden @ lm_head.weight[:VOCAB].T)
    assert controller.counters.fallbacks == 1
    assert controller.counters.rows_dense["error"] == 3


def test_quantized_head_makes_flashhead_unavailable(processor_and_head):
    processor, lm_head = processor_and_head
    controller = processor._my_pkg_flashhead

    class Fp8LinearMethod(UnquantizedEmbeddingMethod):
        pass

    lm_head.quant_method = Fp8LinearMethod()
    _arm(controller, 1)
    hidden = torch.randn(1, HIDDEN)
    torch.testing.assert_close(processor(lm_head, hidden), hidden @ lm_head.weight[:VOCAB].T)
    status = controller.status()
    assert not controller.available and status.reason_code == "quantized_head" and "quantized" in status.reason


def test_a_failing_step_description_falls_back_to_dense(processor_and_head):
    processor, lm_head = processor_and_head
    controller = processor._my_pkg_flashhead

    def broken_rows():
        raise KeyError("input batch changed shape")

    controller.arm(broken_rows)
    hidden = torch.randn(2, HIDDEN)
    torch.testing.assert_close(processor(lm_head, hidden), hidden @ lm_head.weight[:VOCAB].T)
    assert controller.counters.fallbacks == 1


@pytest.mark.parametrize(
    ("change", "code", "fragment"),
    [
        ({"pipeline_parallel_size": 2}, "pipeline_parallel", "pipeline parallel"),
        ({"lora_config": object()}, "lora", "LoRA is enabled"),
        ({"head_dtype": torch.float32}, "head_dtype", "head_dtype"),
    ],
)
def test_unsupported_configurations_are_dense_with_a_reason(change, code, fragment):
    parallel = SimpleNamespace(
        tensor_parallel_size=change.get("tensor_parallel_size", 1),
        pipeline_parallel_size=change.get("pipeline_parallel_size", 1),
    )
    model = SimpleNamespace(dtype=torch.bfloat16, head_dtype=change.get("head_dtype"))
    config = SimpleNamespace(
        parallel_config=parallel,
        model_config=model,
        speculative_config=change.get("speculative_config"),
        lora_config=change.get("lora_config"),
        use_v2_model_runner=change.get("use_v2_model_runner", False),
    )
    found_code, message = engine_setup.unsupported_reason(config)
    assert found_code == code and fragment in message
    plain = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(dtype=torch.bfloat16, head_dtype=None),
        speculative_config=None,
        lora_config=None,
        use_v2_model_runner=False,
    )
    assert engine_setup.unsupported_reason(plain) is None


def _lora_wrapper(base_layer, monkeypatch):
    """vLLM's real LoRA wrapper around `base_layer`, as `--enable-lora` builds it (no adapter loaded)."""
    from vllm.lora.layers import logits_processor as lora_layer

    monkeypatch.setattr(lora_layer, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(lora_layer, "get_tensor_model_parallel_rank", lambda: 0, raising=False)
    monkeypatch.setattr(base_layer, "_gather_logits", lambda logits: logits)  # TP=1, no process group here
    return lora_layer.LogitsProcessorWithLoRA(base_layer, HIDDEN, torch.float32, torch.device("cpu"), None)


class _NoLoRA:
    """The LoRA kernels' wrapper with no active adapter: logits unchanged."""

    def add_lora_logits(self, logits, *args, **kwargs):
        return logits


@pytest.mark.parametrize("with_controller", [False, True], ids=["plain model", "FlashHead model"])
def test_the_lora_wrapper_gets_vllms_own_logits(processor_and_head, with_controller, monkeypatch):
    processor, lm_head = processor_and_head
    controller = processor._my_pkg_flashhead
    if not with_controller:
        processor._my_pkg_flashhead = None
    wrapper = _lora_wrapper(processor, monkeypatch)
    wrapper.punica_wrapper = _NoLoRA()
    wrapper.sharded_to_full_mapping_gpu = None  # set by create_lora_weights at TP=1
    wrapper.lora_a_stacked = wrapper.lora_b_stacked = None
    hidden = torch.randn(3, HIDDEN)
    _arm(controller, 3)  # a decode step announced by the model runner
    # vLLM's wrapper calls `type(base_layer).forward(wrapper, ...)`: `self` is not our instance.
    logits = wrapper(lm_head, hidden)
    torch.testing.assert_close(logits, hidden @ lm_head.weight[:VOCAB].T)
    if with_controller:
        assert controller.counters.rows_dense["lora"] == 3 and controller.counters.rows_flashhead == 0
        assert controller.take_step() is None  # the step was consumed, not left for a later call


def test_an_unknown_caller_of_forward_gets_vllms_forward(processor_and_head):
    processor, lm_head = processor_and_head
    stranger = SimpleNamespace(
        logits_as_input=False,
        soft_cap=None,
        scale=1.0,
        _get_logits=lambda hidden, head, bias, skip: hidden @ head.weight[:VOCAB].T,
    )
    hidden = torch.randn(2, HIDDEN)
    logits = type(processor).forward(stranger, lm_head, hidden)
    torch.testing.assert_close(logits, hidden @ lm_head.weight[:VOCAB].T)


def test_input_batch_hooks_never_raise_into_vllm(monkeypatch):
    """vLLM's own add/remove run and their results come back even when our bookkeeping fails."""
    from vllm import SamplingParams
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    seen = []
    monkeypatch.setattr(InputBatch, "add_request", lambda self, request: seen.append(("add", request)) or 7)
    monkeypatch.setattr(InputBatch, "remove_request", lambda self, req_id: seen.append(("remove", req_id)) or 3)
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    for runner_class, name in (
        (GPUModelRunner, "execute_model"),
        (GPUModelRunner, "load_model"),
        (CPUModelRunner, "load_model"),
    ):
        monkeypatch.setattr(runner_class, name, runner_class.__dict__[name])  # restored afterwards
    model_runner.apply()

    batch = object.__new__(InputBatch)
    odd = object()  # no req_id, no sampling_params
    assert InputBatch.add_request(batch, odd) == 7
    logprobs = SimpleNamespace(req_id="a", sampling_params=SamplingParams(logprobs=1))
    plain = SimpleNamespace(req_id="b", sampling_params=SamplingParams(stop_token_ids=[5]))
    assert InputBatch.add_request(batch, logprobs) == 7 and InputBatch.add_request(batch, plain) == 7
    assert batch.__dict__["_my_pkg_dense_requests"] == {"a": DenseReason.LOGPROBS}
    assert batch.__dict__["_my_pkg_stop_token_ids"] == {"b": (5,)}
    assert InputBatch.remove_request(batch, "a") == 3 and InputBatch.remove_request(batch, "b") == 3
    assert batch.__dict__["_my_pkg_dense_requests"] == {} and batch.__dict__["_my_pkg_stop_token_ids"] == {}
    assert seen == [("add", odd), ("add", logprobs), ("add", plain), ("remove", "a"), ("remove", "b")]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_every_id_vllm_stops_on_is_pinned_the_tokenizers_eos_included(ignore_eos):
    """vLLM keeps the tokenizer's EOS out of `stop_token_ids` (`update_from_generation_config`); the
    hooks pin `all_stop_token_ids`, which holds it and generation_config's EOS ids, even with ignore_eos."""
    from vllm import SamplingParams

    params = SamplingParams(stop_token_ids=[11], ignore_eos=ignore_eos)
    params.update_from_generation_config({"eos_token_id": [9, 7]}, eos_token_id=7)
    assert 7 not in (params.stop_token_ids or [])  # what the plugin used to pin missed it
    assert request_stop_ids(params) == (7, 9, 11)

    batch = _input_batch(2, [0.0, 0.0], {})
    model_runner._track(batch, SimpleNamespace(req_id="r1", sampling_params=params))
    model_runner._track(batch, SimpleNamespace(req_id="r0", sampling_params=SamplingParams()))
    rows = model_runner.step_rows(batch)
    assert rows.stop_ids == (7, 9, 11) and rows.dense_codes.tolist() == [0, 0]


def _eos_params(stop_token_ids=None):
    """vLLM's `SamplingParams` of a request to a model whose EOS ids are 7 and 9 (`all_stop_token_ids`)."""
    from vllm import SamplingParams

    params = SamplingParams(stop_token_ids=stop_token_ids)
    params.update_from_generation_config({"eos_token_id": [9, 7]}, eos_token_id=7)
    return params


def test_stop_ids_the_controller_pins_anyway_are_left_out_and_an_extra_one_is_pinned_while_its_request_runs(
    monkeypatch,
):
    """Through the hooked `execute_model` / `add_request` / `remove_request`: the step shares the controller's
    pinned ids with the batch before vLLM adds its requests, so a request stopping on EOS only carries no stop
    ids (a step of such requests looks at none); a request with another stop id has it pinned until it leaves."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from my_pkg.engine.flashhead.pins import PinnedRows
    from my_pkg.engine.patches import runner_hooks

    monkeypatch.setattr(InputBatch, "add_request", lambda self, request: None)
    monkeypatch.setattr(InputBatch, "remove_request", lambda self, req_id: None)

    def execute_model(self, new=(), finished=()):  # vLLM's order: the batch is updated, then the logits
        for request in new:
            InputBatch.add_request(self.input_batch, request)
        for req_id in finished:
            InputBatch.remove_request(self.input_batch, req_id)
        return model_runner.step_rows(self.input_batch)

    monkeypatch.setattr(GPUModelRunner, "execute_model", execute_model)
    for runner_class in (GPUModelRunner, CPUModelRunner):
        monkeypatch.setattr(runner_class, "load_model", runner_class.__dict__["load_model"])  # restored afterwards
    model_runner.apply()

    controller = FlashHeadController(centroids=None, assignments=None, config={}, vocab_size=VOCAB, pinned_ids=(7, 9))
    runner = object.__new__(GPUModelRunner)
    runner.__dict__[runner_hooks.CONTROLLER_ATTR] = controller
    runner.__dict__["input_batch"] = batch = _input_batch(2, [0.0, 0.7], {})
    pins, weight = PinnedRows(controller.pinned_ids, (0, VOCAB)), torch.randn(VOCAB, HIDDEN)

    def pinned(rows):
        return pins.get(rows.stop_ids, weight)[0].tolist()

    rows = GPUModelRunner.execute_model(runner, new=[SimpleNamespace(req_id="r0", sampling_params=_eos_params())])
    assert batch.__dict__.get("_my_pkg_stop_token_ids") == {}  # EOS only: nothing to walk at each step
    assert rows.stop_ids == () and pinned(rows) == [7, 9]

    extra = SimpleNamespace(req_id="r1", sampling_params=_eos_params([11, 7]))
    rows = GPUModelRunner.execute_model(runner, new=[extra])
    assert batch.__dict__["_my_pkg_stop_token_ids"] == {"r1": (11,)}
    assert rows.stop_ids == (11,) and pinned(rows) == [7, 9, 11]

    rows = GPUModelRunner.execute_model(runner, finished=["r1"])
    assert batch.__dict__["_my_pkg_stop_token_ids"] == {}
    assert rows.stop_ids == () and pinned(rows) == [7, 9]


def test_sharing_the_pinned_ids_is_once_per_controller_tuple():
    from my_pkg.engine.patches import runner_hooks

    batch = _input_batch(1, [0.0], {})
    runner_hooks.share_pinned_ids(batch, None)  # no controller: requests keep every stop id
    assert runner_hooks.shared_pinned_ids(batch) == frozenset()
    first = SimpleNamespace(pinned_ids=(7, 9))
    runner_hooks.share_pinned_ids(batch, first)
    shared = runner_hooks.shared_pinned_ids(batch)
    runner_hooks.share_pinned_ids(batch, first)
    assert runner_hooks.shared_pinned_ids(batch) is shared == {7, 9}
    runner_hooks.share_pinned_ids(batch, SimpleNamespace(pinned_ids=(7,)))  # a reloaded model's controller
    assert runner_hooks.shared_pinned_ids(batch) == {7}
    assert runner_hooks.classify(_eos_params([11]), runner_hooks.shared_pinned_ids(batch)) == (0, (9, 11))


def test_the_union_of_stop_ids():
    from my_pkg.engine.patches.runner_hooks import union_stop_ids

    assert union_stop_ids([]) == ()
    assert union_stop_ids([(4, 9), (4, 9)]) == (4, 9)
    assert union_stop_ids([(9,), (4, 9), (2,)]) == (2, 4, 9)


@pytest.mark.slow
def test_the_tokenizer_vllm_loads_gives_its_eos_even_as_a_non_special_added_token(tmp_path):
    """`--tokenizer` in another directory than the model's, whose EOS was added with `add_tokens`
    (special=false, as in many ChatML fine-tunes): its id is pinned, read from the tokenizer vLLM loads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "hello": 2, "world": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>")
    tokenizer.add_tokens(["<|im_end|>"])  # not special
    tokenizer.eos_token = "<|im_end|>"
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == end == 4 and not tokenizer.added_tokens_decoder[end].special
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    from my_pkg.flashhead.assets import stop_and_special_token_ids

    assert end not in stop_and_special_token_ids(tokenizer_dir, {})  # the model files alone miss it

    from vllm.tokenizers.registry import cached_get_tokenizer

    cached_get_tokenizer.cache_clear()
    model_config = SimpleNamespace(
        tokenizer=str(tokenizer_dir),
        tokenizer_mode="auto",
        runner_type="generate",
        tokenizer_revision=None,
        trust_remote_code=False,
        skip_tokenizer_init=False,
        hf_config=None,
    )
    pinned = engine_setup.tokenizer_stop_and_special_ids(model_config)
    assert end in pinned and 1 in pinned and 0 in pinned
    assert engine_setup.tokenizer_stop_and_special_ids(SimpleNamespace(skip_tokenizer_init=True, hf_config=None)) == []
    assert (
        engine_setup.tokenizer_stop_and_special_ids(
            SimpleNamespace(**{**vars(model_config), "tokenizer": str(tmp_path / "missing")})
        )
        == []
    )


# ---- the head is built right after the weights load --------------------------------------------


def _vocab_modules(kind: str):
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    model = torch.nn.Module()
    model.embed_tokens = VocabParallelEmbedding(VOCAB, HIDDEN, disable_tp=True)
    if kind == "untied":
        model.lm_head = ParallelLMHead(VOCAB, HIDDEN, disable_tp=True)
    elif kind == "tied":
        model.lm_head = model.embed_tokens
    elif kind == "two heads":
        model.heads = torch.nn.ModuleList([ParallelLMHead(VOCAB, HIDDEN, disable_tp=True) for _ in range(2)])
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # vLLM allocates the weights uninitialised and loads them; these stand for the loaded ones
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("untied", "lm_head"), ("tied", "embed_tokens"), ("embedding only (Gemma)", "embed_tokens"), ("two heads", None)],
)
def test_the_lm_head_is_found_among_vllms_modules(kind, expected):
    from my_pkg.engine.patches.runner_hooks import lm_head_of

    model = _vocab_modules(kind)
    found = lm_head_of(model)
    assert found is (getattr(model, expected) if expected else None)


def test_the_head_and_its_tables_are_built_right_after_the_weights_load(processor_and_head):
    """Before vLLM profiles memory: the KV cache is sized with the head's memory already allocated."""
    from my_pkg.engine.patches import runner_hooks

    processor, _ = processor_and_head
    controller = processor._my_pkg_flashhead
    model = _vocab_modules("untied")
    model.logits_processor = processor
    torch.manual_seed(0)
    model.lm_head.weight.data.normal_()

    class Runner:  # stands in for vLLM's runner: load_model sets `model`, get_model returns it
        def load_model(self):
            self.model = model

        def get_model(self):
            return self.model

    runner_hooks.hook_load_model(Runner)
    runner = Runner()
    assert controller.head is None and controller.status().reason_code == "not_built"
    runner.load_model()
    assert controller.head is not None and controller.head.weight is model.lm_head.weight
    assert controller.head.estimate.built is not None  # the sampled rows' tables too
    status = controller.status()
    assert status.active and status.extra_memory_bytes >= controller.head.estimate.built.nbytes
    assert controller.counters.steps == 0  # warmed up on zero rows, no step counted

    hidden = torch.randn(2, HIDDEN)
    dense = hidden @ model.lm_head.weight[:VOCAB].T
    _arm(controller, 2)
    logits = processor(model.lm_head, hidden)
    finite = torch.isfinite(logits)
    assert controller.counters.rows_flashhead == 2 and not finite.all()
    torch.testing.assert_close(logits[finite], dense[finite])

    other = SimpleNamespace(weight=model.lm_head.weight.clone(), quant_method=UnquantizedEmbeddingMethod(), tp_size=1)
    _arm(controller, 2)  # a head built over another weight is never used: dense, with the reason
    torch.testing.assert_close(processor(other, hidden), hidden @ other.weight[:VOCAB].T)
    assert controller.status().reason_code == "build_failed"


def test_under_sleep_mode_the_head_is_built_at_the_first_logits_call(processor_and_head):
    """vLLM loads the weights into its sleep-mode pool, which sleep level 2 discards: not the head's place."""
    from my_pkg.engine.patches import runner_hooks

    processor, lm_head = processor_and_head
    controller = processor._my_pkg_flashhead

    model = _vocab_modules("untied")  # an LM head the load hook would find
    model.logits_processor = processor
    model.lm_head.weight.data.normal_()

    class Runner:
        model_config = SimpleNamespace(enable_sleep_mode=True)

        def load_model(self):
            self.model = model

        def get_model(self):
            return self.model

    runner_hooks.hook_load_model(Runner)
    Runner().load_model()
    assert controller.head is None
    Runner.model_config = SimpleNamespace(enable_sleep_mode=False)
    Runner().load_model()
    assert controller.head is not None  # the same load without sleep mode builds it


def test_a_load_hook_that_fails_leaves_vllms_load_and_the_lazy_build(processor_and_head, monkeypatch):
    from my_pkg.engine.patches import runner_hooks

    processor, lm_head = processor_and_head
    controller = processor._my_pkg_flashhead

    class Runner:
        def load_model(self):
            self.model = torch.nn.Module()
            self.model.logits_processor = processor
            return "loaded"

        def get_model(self):
            return self.model

    def broken(model):
        raise RuntimeError("odd model")

    monkeypatch.setattr(runner_hooks, "lm_head_of", broken)
    runner_hooks.hook_load_model(Runner)
    assert Runner().load_model() == "loaded" and controller.head is None
    _arm(controller, 1)
    processor(lm_head, torch.randn(1, HIDDEN))  # the first logits call builds it
    assert controller.head is not None and controller.counters.rows_flashhead == 1


def test_the_model_loader_builds_the_head_of_the_load_that_installed_the_hooks(processor_and_head, monkeypatch):
    """The hooks are installed while vLLM resolves the architecture, inside the runner's `load_model`; vLLM's
    loader looks `process_weights_after_loading` up when it calls it, after that, so the wrapped one builds the
    head of this very load, with vLLM's model dtype as torch's default (as while vLLM loads)."""
    import inspect

    from vllm.model_executor.model_loader import base_loader

    from my_pkg.engine.patches import model_loader

    assert "process_weights_after_loading" in inspect.unwrap(base_loader.BaseModelLoader.load_model).__code__.co_names
    loaded = []  # vLLM's own function needs a whole ModelConfig; it stands in, to see it run first
    monkeypatch.setattr(base_loader, "process_weights_after_loading", lambda *args: loaded.append(args))
    model_loader.apply()
    model_loader.apply()  # applying twice wraps once
    wrapped = base_loader.process_weights_after_loading
    assert getattr(wrapped, "_my_pkg_wrapped", False) and not getattr(wrapped.__wrapped__, "_my_pkg_wrapped", False)

    processor, _ = processor_and_head
    controller = processor._my_pkg_flashhead
    model = _vocab_modules("untied")
    model.logits_processor = processor
    config = SimpleNamespace(dtype=torch.bfloat16, enable_sleep_mode=False, quantization=None)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        wrapped(model, config, torch.device("cpu"))
    finally:
        torch.set_default_dtype(previous)
    assert loaded == [(model, config, torch.device("cpu"))]
    assert controller.head is not None and controller.head.weight is model.lm_head.weight
    assert controller.status().active and controller.head.estimate.built is not None

    asleep = _vocab_modules("untied")
    asleep.logits_processor = logits_processor.subclass()(VOCAB)
    asleep.logits_processor._my_pkg_flashhead = FlashHeadController(
        centroids=controller.head.centroids.float(),
        assignments=torch.arange(VOCAB) % (VOCAB // CAP),
        config={"n_probes": 2},
        vocab_size=VOCAB,
    )
    wrapped(asleep, SimpleNamespace(dtype=torch.float32, enable_sleep_mode=True, quantization=None), "cpu")
    assert asleep.logits_processor._my_pkg_flashhead.head is None  # sleep mode: the first logits call builds it
    wrapped(_vocab_modules("untied"), config, "cpu")  # no FlashHead controller: vLLM's own, nothing else
    assert len(loaded) == 3


def test_every_runner_vllm_may_use_builds_the_head_after_load(flashhead_hooks):
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for runner_class in (GPUModelRunner, CPUModelRunner, V2Runner):
        assert getattr(runner_class.__dict__["load_model"], "_my_pkg_wrapped", False), runner_class
