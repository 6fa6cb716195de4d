"""FlashHead under vLLM's Model Runner V2, driven through V2's own Python classes on CPU.

V2 itself cannot run here (its kernels are Triton kernels for a GPU backend). These tests
build V2's real `RequestState`, `Sampler` (with its `SamplingStates` and logits-processor
states), `PromptLogprobsWorker`, `LoraState` and `InputBatch`, and call V2's real
`GPUModelRunner.finish_requests` / `add_requests` / `update_requests` /
`gather_batch_req_state` / `sample` on a runner object. Stand-ins replace only what needs a
GPU: pinned host buffers (V2's own non-UVA fallback is used), the staged-write Triton kernel
(emulated on CPU), KV block tables, the model (a tiny LM head around the real FlashHead
logits processor) and its model state, the input-preparation kernels (the batch is V2's
dummy batch given the row-to-slot mapping V2 computed) and the Gumbel sampling kernel
(a greedy argmax).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from my_pkg.engine import patches
from my_pkg.engine.flashhead.rows import DenseReason
from my_pkg.engine.flashhead.spec import spec_state
from my_pkg.engine.patches import logits_processor, model_runner, model_runner_v2, runner_hooks
from my_pkg.flashhead.assets import save_clustering_cache
from tests.support.vllm_fakes import UnquantizedEmbeddingMethod

VOCAB, HIDDEN, CAP, SLOTS = 256, 16, 16, 8
STOP = VOCAB - 3


@pytest.fixture
def v2(monkeypatch):
    """V2's modules with their GPU-only parts replaced by CPU equivalents; hooks restored afterwards."""
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)  # pinned memory needs an accelerator

    def apply_write_on_cpu(self) -> None:  # what V2's `_apply_write_kernel` does on the device
        start_of_next = 0
        for index, start, end in zip(self._staged_write_indices, self._staged_write_starts, self._staged_write_cu_lens):
            values = torch.tensor(self._staged_write_contents[start_of_next:end], dtype=self.gpu.dtype)
            if self.gpu.dim() == 1:
                self.gpu[index] = values[0]
            else:
                self.gpu[index, start : start + values.numel()] = values
            start_of_next = end
        self.clear_staged_writes()

    monkeypatch.setattr(buffer_utils.StagedWriteTensor, "apply_write", apply_write_on_cpu)
    monkeypatch.setattr(Sampler, "add_request", Sampler.add_request)  # restored after the test
    monkeypatch.setattr(GPUModelRunner, "sample", GPUModelRunner.sample)
    return SimpleNamespace(GPUModelRunner=GPUModelRunner, Sampler=Sampler)


def _greedy_sampler_class(sampler_class):
    class GreedyCpuSampler(sampler_class):
        """V2's `Sampler`; only its Triton sampling kernels are replaced, by an argmax on CPU."""

        def __call__(self, logits, input_batch):
            self.seen_logits = logits
            num_reqs = input_batch.num_reqs
            return SimpleNamespace(
                sampled_token_ids=logits.argmax(dim=1, keepdim=True),
                num_sampled=torch.ones(num_reqs, dtype=torch.int32),
                num_rejected=torch.zeros(num_reqs, dtype=torch.int32),
            )

    return GreedyCpuSampler


class TinyLM(torch.nn.Module):
    """Stands in for the model on the GPU: just its LM head and logits processor."""

    def __init__(self, processor, lm_head) -> None:
        super().__init__()
        self.logits_processor = processor
        self.lm_head = lm_head

    def compute_logits(self, hidden_states):
        return self.logits_processor(self.lm_head, hidden_states)


def _lm_head():
    torch.manual_seed(0)
    return SimpleNamespace(weight=torch.randn(VOCAB, HIDDEN), quant_method=UnquantizedEmbeddingMethod(), tp_size=1)


def _vllm_config(model_dir, *, use_v2: bool, flashhead: bool = True):
    hf = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "n_probes": 2}
    if flashhead:
        hf["flash_head_cache_dir"] = "flash_head_assets"
    model_config = SimpleNamespace(
        model=str(model_dir),
        revision=None,
        dtype=torch.float32,
        head_dtype=None,
        hf_config=SimpleNamespace(to_dict=lambda: dict(hf)),
    )
    return SimpleNamespace(
        model_config=model_config,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        speculative_config=None,
        lora_config=None,
        use_v2_model_runner=use_v2,
        device_config=SimpleNamespace(device_type="cpu"),
    )


def _processor(tmp_path, lm_head, *, use_v2: bool = True, flashhead: bool = True):
    """The FlashHead logits processor as vLLM builds it for a FlashHead model, once its architecture was
    resolved (`patches.on_flashhead_model`, which the `flashhead_hooks` fixture or the test calls)."""
    from vllm.config import set_current_vllm_config

    weight = lm_head.weight
    assignments = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1)) % (VOCAB // CAP)
    centroids = torch.stack([weight[assignments == c].mean(0) for c in range(VOCAB // CAP)])
    save_clustering_cache(tmp_path, centroids, assignments)
    with set_current_vllm_config(_vllm_config(tmp_path, use_v2=use_v2, flashhead=flashhead)):
        return logits_processor.subclass()(VOCAB)


def _runner(v2, model=None):
    """A V2 `GPUModelRunner` with V2's real request and sampler state on CPU."""
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu.lora_utils import LoraState
    from vllm.v1.worker.gpu.sample.prompt_logprob import PromptLogprobsWorker
    from vllm.v1.worker.gpu.states import RequestState

    cpu = torch.device("cpu")
    runner = v2.GPUModelRunner.__new__(v2.GPUModelRunner)
    runner.max_num_reqs, runner.decode_query_len, runner.vocab_size = SLOTS, 1, VOCAB
    runner.req_states = RequestState(
        max_num_reqs=SLOTS,
        max_model_len=64,
        max_num_batched_tokens=64,
        num_speculative_steps=0,
        vocab_size=VOCAB,
        device=cpu,
    )
    runner.sampler = _greedy_sampler_class(v2.Sampler)(
        vllm_config=VllmConfig(), max_num_reqs=SLOTS, vocab_size=VOCAB, device=cpu, req_states=runner.req_states
    )
    runner.prompt_logprobs_worker = PromptLogprobsWorker(SLOTS, cpu)
    runner.lora_state = LoraState(SLOTS)
    runner.model_state = SimpleNamespace(
        add_request=lambda *a: None, remove_request=lambda *a: None, apply_staged_writes=lambda: None
    )
    runner.block_tables = SimpleNamespace(append_block_ids=lambda *a, **k: None)
    runner.kv_block_zeroer = None
    runner.adaptive_verification = runner.pooling_runner = runner.encoder_cache = runner.pp_handler = None
    runner.pcp_manager = runner.batch_sharder = runner.rejection_sampler = runner.speculator = None
    runner.is_last_pp_rank, runner.use_pp = True, False
    runner.model = model
    return runner


def _request(req_id, **sampling):
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData

    prompt = [1, 2, 3]
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=prompt,
        mm_features=[],
        sampling_params=SamplingParams(**sampling),
        pooling_params=None,
        block_ids=([],),
        num_computed_tokens=0,
        lora_request=None,
        prefill_token_ids=prompt,
    )


def _step(runner, *, new=(), finished=(), decoding=()):
    """One step of V2's request bookkeeping; the step's `InputBatch` with V2's row -> slot mapping."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    output = SchedulerOutput.make_empty()
    output.scheduled_new_reqs = list(new)
    output.finished_req_ids = set(finished)
    output.num_scheduled_tokens = {**{r.req_id: 3 for r in new}, **{req_id: 1 for req_id in decoding}}
    output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
    runner.finish_requests(output)
    runner.add_requests(output)
    runner.update_requests(output)
    state, _ = runner.gather_batch_req_state(output, dummy_run=False)
    num_reqs = len(state.req_ids)
    batch = InputBatch.make_dummy(num_reqs, num_reqs, InputBuffers(SLOTS, 64, torch.device("cpu")))
    slots = torch.from_numpy(state.idx_mapping_np).to(torch.int64)
    return dataclasses.replace(
        batch, req_ids=state.req_ids, idx_mapping_np=state.idx_mapping_np, idx_mapping=slots, expanded_idx_mapping=slots
    )


def _by_request(batch, values):
    return dict(zip(batch.req_ids, np.asarray(values).tolist()))


def test_rows_follow_v2s_slots_across_removals_and_reuse(v2):
    model_runner_v2.apply()
    runner = _runner(v2)
    batch = _step(
        runner,
        new=[
            _request("greedy", temperature=0.0),
            _request("logprobs", temperature=0.0, logprobs=1),
            _request("seeded", temperature=0.8, seed=7, stop_token_ids=[STOP]),
            _request("sampled", temperature=0.9),
        ],
    )
    rows = model_runner_v2.step_rows(runner.sampler, batch)
    assert _by_request(batch, rows.dense_codes) == {
        "greedy": 0,
        "logprobs": DenseReason.LOGPROBS,
        "seeded": 0,
        "sampled": 0,
    }
    assert _by_request(batch, rows.sampled) == {"greedy": False, "logprobs": False, "seeded": True, "sampled": True}
    assert rows.stop_ids == (STOP,)

    freed = runner.req_states.req_id_to_index["seeded"]
    batch = _step(
        runner,
        finished={"seeded"},
        new=[_request("late", temperature=0.5, logit_bias={4: 1.0})],
        decoding=("greedy", "logprobs", "sampled"),
    )
    assert runner.req_states.req_id_to_index["late"] == freed  # V2 hands the freed slot to the next request
    assert batch.req_ids[:3] == ["greedy", "logprobs", "sampled"]  # V2 orders decodes before prefills
    rows = model_runner_v2.step_rows(runner.sampler, batch)
    assert _by_request(batch, rows.dense_codes) == {
        "greedy": 0,
        "logprobs": DenseReason.LOGPROBS,
        "sampled": 0,
        "late": DenseReason.LOGIT_BIAS,
    }
    assert _by_request(batch, rows.sampled) == {"greedy": False, "logprobs": False, "sampled": True, "late": True}
    assert rows.stop_ids == ()  # the seeded request and its stop ids left with its slot

    batch = _step(
        runner, finished={"late", "logprobs"}, new=[_request("again", temperature=0.0)], decoding=("greedy", "sampled")
    )
    rows = model_runner_v2.step_rows(runner.sampler, batch)
    assert _by_request(batch, rows.dense_codes) == {"greedy": 0, "sampled": 0, "again": 0}


def test_a_request_with_several_logits_rows_gets_one_code_per_row(v2):
    model_runner_v2.apply()
    runner = _runner(v2)
    batch = _step(runner, new=[_request("a", temperature=0.0, logprobs=2), _request("b", temperature=0.7)])
    batch = dataclasses.replace(batch, cu_num_logits_np=np.array([0, 2, 3], dtype=np.int32))
    rows = model_runner_v2.step_rows(runner.sampler, batch)
    first, second = batch.req_ids
    expected = {"a": DenseReason.LOGPROBS, "b": 0}
    assert rows.dense_codes.tolist() == [expected[first]] * 2 + [expected[second]]
    assert rows.num_rows == 3


def test_custom_logits_processors_make_every_row_dense(v2):
    model_runner_v2.apply()
    runner = _runner(v2)

    class MyLogitsProcessor:
        def add_request(self, req_idx, sampling_params):
            return False

        def apply_staged_writes(self):
            pass

    runner.sampler.logits_processors.append(MyLogitsProcessor())
    batch = _step(runner, new=[_request("a", temperature=0.0), _request("b", temperature=0.0)])
    rows = model_runner_v2.step_rows(runner.sampler, batch)
    assert rows.dense_codes.tolist() == [DenseReason.CUSTOM_LOGITS_PROCESSORS] * 2


def test_the_add_request_hook_never_raises_into_vllm(v2, monkeypatch):
    model_runner_v2.apply()
    runner = _runner(v2)

    def unclassifiable(params):
        raise TypeError("odd request")

    with monkeypatch.context() as patched:
        patched.setattr(runner_hooks, "request_dense_reason", unclassifiable)
        batch = _step(runner, new=[_request("odd", temperature=0.0)])
    assert model_runner_v2.step_rows(runner.sampler, batch).dense_codes.tolist() == [DenseReason.UNCLASSIFIED]

    batch = _step(runner, finished={"odd"}, new=[_request("plain", temperature=0.0)])
    assert model_runner_v2.step_rows(runner.sampler, batch).dense_codes.tolist() == [0]

    def broken_track(sampler, slot, params):
        raise RuntimeError("bookkeeping failed")

    monkeypatch.setattr(model_runner_v2, "track", broken_track)
    batch = _step(runner, new=[_request("next", temperature=0.6)], decoding=("plain",))
    slot = runner.req_states.req_id_to_index["next"]
    assert runner.sampler.sampling_states.temperature.np[slot] == pytest.approx(0.6)  # vLLM's own add happened
    rows = model_runner_v2.step_rows(runner.sampler, batch)
    assert rows.dense_codes.tolist() == [DenseReason.UNCLASSIFIED] * 2  # nothing trusted after a failure


def test_sample_serves_the_decode_step_through_flashhead_and_nothing_else(v2, tmp_path, flashhead_hooks):
    lm_head = _lm_head()
    processor = _processor(tmp_path, lm_head)  # builds the controller; its hooks are installed
    controller = processor._my_pkg_flashhead
    assert controller.available and getattr(v2.GPUModelRunner.sample, "_my_pkg_wrapped", False)
    runner = _runner(v2, TinyLM(processor, lm_head))
    batch = _step(
        runner,
        new=[
            _request("greedy", temperature=0.0),
            _request("logprobs", temperature=0.0, logprobs=1),
            _request("seeded", temperature=0.8, seed=7, stop_token_ids=[STOP]),
        ],
    )
    hidden = torch.randn(batch.num_reqs, HIDDEN)
    dense = hidden @ lm_head.weight.T

    runner.sample(hidden, batch, None)
    logits = runner.sampler.seen_logits
    row = {req_id: i for i, req_id in enumerate(batch.req_ids)}
    torch.testing.assert_close(logits[row["logprobs"]], dense[row["logprobs"]])  # exact dense row
    finite = torch.isfinite(logits[row["greedy"]])
    assert 0 < int(finite.sum()) < VOCAB // 2  # candidates only
    torch.testing.assert_close(logits[row["greedy"]][finite], dense[row["greedy"]][finite])
    assert torch.isfinite(logits[row["seeded"]]).all()  # a sampled row: estimates for the unprobed tokens
    torch.testing.assert_close(logits[row["seeded"], STOP], dense[row["seeded"], STOP])  # its stop id is exact
    assert controller.counters.rows_flashhead == 2 and controller.counters.rows_dense["logprobs"] == 1
    assert controller.counters.steps == 1

    # After `sample`, V2's prompt-logprobs calls use the same compute_logits: disarmed, dense.
    torch.testing.assert_close(runner.model.compute_logits(hidden), dense)
    assert controller.counters.steps == 1 and controller.take_step() is None


def test_pinned_stop_ids_are_left_out_and_an_extra_stop_id_is_pinned_while_its_request_runs(
    v2, tmp_path, flashhead_hooks
):
    """V2's load hook shares the controller's pinned ids (EOS) with the sampler: a request stopping on EOS only
    carries no stop ids, so the step's union is empty; another stop id is scored exactly while its request runs,
    and no longer once it left (its slot may stay in the table until reused)."""
    eos = VOCAB - 5
    lm_head = _lm_head()
    processor = _processor(tmp_path, lm_head)
    controller = processor._my_pkg_flashhead
    controller.pinned_ids = (eos,)  # the tokenizer's EOS; the head (built at the first logits call) pins it
    runner = _runner(v2, TinyLM(processor, lm_head))
    runner_hooks.prepare_after_load(runner, "sampler")  # what the hooked load_model does (the head is built lazily)

    batch = _step(runner, new=[_request("plain", temperature=0.0, stop_token_ids=[eos])])
    assert runner.sampler.__dict__.get("_my_pkg_stop_token_ids") == {}
    assert model_runner_v2.step_rows(runner.sampler, batch).stop_ids == ()

    batch = _step(runner, new=[_request("extra", temperature=0.8, stop_token_ids=[STOP, eos])], decoding=("plain",))
    assert model_runner_v2.step_rows(runner.sampler, batch).stop_ids == (STOP,)
    hidden = torch.randn(batch.num_reqs, HIDDEN)
    dense = hidden @ lm_head.weight.T
    runner.sample(hidden, batch, None)
    logits = runner.sampler.seen_logits
    assert controller.counters.rows_flashhead == 2
    torch.testing.assert_close(logits[:, [STOP, eos]], dense[:, [STOP, eos]])  # exact on every row
    assert controller._pins.get((STOP,), lm_head.weight)[0].tolist() == sorted([STOP, eos])

    batch = _step(runner, finished={"extra"}, decoding=("plain",))
    assert model_runner_v2.step_rows(runner.sampler, batch).stop_ids == ()
    assert controller._pins.get((), lm_head.weight)[0].tolist() == [eos]


def test_sample_shares_the_pinned_ids_when_the_load_hook_did_not(v2, tmp_path, flashhead_hooks):
    eos = VOCAB - 5
    lm_head = _lm_head()
    processor = _processor(tmp_path, lm_head)
    processor._my_pkg_flashhead.pinned_ids = (eos,)
    runner = _runner(v2, TinyLM(processor, lm_head))
    batch = _step(runner, new=[_request("early", temperature=0.0, stop_token_ids=[eos])])
    assert model_runner_v2.step_rows(runner.sampler, batch).stop_ids == (eos,)  # joined before: keeps its ids
    runner.sample(torch.randn(1, HIDDEN), batch, None)
    batch = _step(runner, new=[_request("late", temperature=0.0, stop_token_ids=[eos])], decoding=("early",))
    slots = runner.req_states.req_id_to_index
    assert runner.sampler.__dict__["_my_pkg_stop_token_ids"] == {slots["early"]: (eos,)}  # "late" carries none
    batch = _step(runner, finished={"early"}, decoding=("late",))
    assert model_runner_v2.step_rows(runner.sampler, batch).stop_ids == ()


def test_sample_of_a_model_without_flashhead_is_vllms_own(v2, tmp_path, flashhead_hooks):
    model_runner_v2.apply()
    lm_head = _lm_head()
    processor = _processor(tmp_path, lm_head, flashhead=False)
    assert processor._my_pkg_flashhead is None
    runner = _runner(v2, TinyLM(processor, lm_head))
    batch = _step(runner, new=[_request("a", temperature=0.0), _request("b", temperature=0.5)])
    hidden = torch.randn(batch.num_reqs, HIDDEN)
    runner.sample(hidden, batch, None)
    torch.testing.assert_close(runner.sampler.seen_logits, hidden @ lm_head.weight.T)


def test_a_failing_step_description_is_dense_and_the_runner_is_disarmed(v2, tmp_path, flashhead_hooks):
    lm_head = _lm_head()
    processor = _processor(tmp_path, lm_head)
    controller = processor._my_pkg_flashhead
    runner = _runner(v2, TinyLM(processor, lm_head))
    batch = _step(runner, new=[_request("a", temperature=0.0)])
    del runner.sampler.sampling_states.temperature  # a V2 field gone in some future vLLM
    hidden = torch.randn(1, HIDDEN)
    runner.sample(hidden, batch, None)
    torch.testing.assert_close(runner.sampler.seen_logits, hidden @ lm_head.weight.T)
    assert controller.counters.fallbacks == 1 and controller.take_step() is None


class DeviceLost(RuntimeError):
    pass


def test_a_step_that_fails_before_its_logits_leaves_the_controller_disarmed(v2, tmp_path, flashhead_hooks):
    lm_head = _lm_head()
    processor = _processor(tmp_path, lm_head)
    controller = processor._my_pkg_flashhead
    model = TinyLM(processor, lm_head)
    runner = _runner(v2, model)
    batch = _step(runner, new=[_request("a", temperature=0.0)])

    def lost(hidden_states):
        raise DeviceLost("device lost")

    model.compute_logits = lost
    with pytest.raises(DeviceLost):  # vLLM's own error, unchanged
        runner.sample(torch.randn(1, HIDDEN), batch, None)
    assert controller.take_step() is None  # a later logits call (prompt logprobs) is not taken for the step


def test_batch_sharded_sampling_is_not_armed(v2, tmp_path, flashhead_hooks):
    lm_head = _lm_head()
    processor = _processor(tmp_path, lm_head)
    controller = processor._my_pkg_flashhead
    runner = _runner(v2, TinyLM(processor, lm_head))
    batch = _step(runner, new=[_request("a", temperature=0.0)])
    seen = []

    def shard_sampler_inputs(input_batch, grammar_output):  # stands in for the TP all-to-all path
        seen.append(controller.take_step())
        raise DeviceLost("no TP group here")

    runner.batch_sharder = SimpleNamespace(shard_sampler_inputs=shard_sampler_inputs)
    with pytest.raises(DeviceLost):
        runner.sample(torch.randn(1, HIDDEN), batch, None)
    assert seen == [None]


# ---- speculative decoding: V2's verify rows ------------------------------------------------------

NGRAM = SimpleNamespace(method="ngram", num_speculative_tokens=3, draft_sample_method="greedy")


def _spec_batch(batch, drafts_per_request, *, seed=0):
    """`batch` as V2's `prepare_inputs` lays out a step with `drafts_per_request` drafts: each request's
    query is its last sampled token then its drafts, and its logits rows are the last `n + 1` positions
    (`combine_sampled_and_draft_tokens`); input ids are random tokens."""
    n = np.asarray(drafts_per_request, dtype=np.int32)
    query_end = np.cumsum(n + 1 + 2)  # each query two tokens longer than its logits rows: rows != positions
    logits_indices = np.concatenate([np.arange(end - k - 1, end) for end, k in zip(query_end, n)])
    cu_num_logits = np.concatenate([[0], np.cumsum(n + 1)]).astype(np.int32)
    input_ids = torch.randint(0, VOCAB, (int(query_end[-1]),), generator=torch.Generator().manual_seed(seed))
    return dataclasses.replace(
        batch,
        num_draft_tokens=int(n.sum()),
        num_draft_tokens_per_req=n,
        cu_num_logits_np=cu_num_logits,
        cu_num_logits=torch.from_numpy(cu_num_logits),
        logits_indices=torch.from_numpy(logits_indices),
        input_ids=input_ids,
    )


def _drafts_the_rejection_sampler_reads(batch, verify_rows):
    """V2's `gather_draft_sampled` reads each logits row's input token; row `r` verifies row `r + 1`'s."""
    draft_sampled = batch.input_ids[batch.logits_indices]
    return draft_sampled[torch.from_numpy(verify_rows + 1)]


def _spec_runner(v2, tmp_path, speculative_config=NGRAM):
    lm_head = _lm_head()
    processor = _processor(tmp_path, lm_head)
    controller = processor._my_pkg_flashhead
    controller.spec = spec_state(speculative_config, v2=True, hook_error=None)
    runner = _runner(v2, TinyLM(processor, lm_head))
    runner.speculative_config = speculative_config
    runner.speculator = SimpleNamespace(draft_logits=None)

    def rejection_sampler(logits, input_batch, draft_logits, invalid_drafts):  # V2's is Triton kernels
        runner.sampler.seen_logits = logits
        return SimpleNamespace(num_sampled=None, num_rejected=None)

    runner.rejection_sampler = rejection_sampler
    return runner, controller, lm_head


def test_v2_verify_rows_follow_its_logits_layout_and_their_drafts_are_what_its_rejection_sampler_reads(v2):
    model_runner_v2.apply()
    runner = _runner(v2)
    runner.speculative_config = NGRAM
    batch = _step(
        runner,
        new=[
            _request("greedy", temperature=0.0),
            _request("sampled", temperature=0.7),
            _request("logprobs", temperature=0.9, logprobs=1),
        ],
    )
    order = {req_id: i for i, req_id in enumerate(batch.req_ids)}
    drafts = [{"greedy": 2, "sampled": 3, "logprobs": 1}[req_id] for req_id in batch.req_ids]
    batch = _spec_batch(batch, drafts)
    rows = model_runner_v2.runner_step_rows(runner, runner.sampler, batch)

    assert rows.all_dense is None and rows.num_rows == sum(drafts) + 3
    first = np.concatenate([[0], np.cumsum(np.asarray(drafts) + 1)])
    expected_verify = np.concatenate([np.arange(first[i], first[i + 1] - 1) for i in range(3)])
    assert rows.verify_rows.tolist() == expected_verify.tolist()
    code = {"greedy": 0, "sampled": 0, "logprobs": DenseReason.LOGPROBS}
    for req_id, i in order.items():
        assert rows.dense_codes[first[i] : first[i + 1]].tolist() == [code[req_id]] * (drafts[i] + 1)
        assert rows.sampled[first[i] : first[i + 1]].tolist() == [req_id != "greedy"] * (drafts[i] + 1)


def test_v2_sample_serves_verify_rows_as_flashhead_without_speculation(v2, tmp_path, flashhead_hooks):
    runner, controller, lm_head = _spec_runner(v2, tmp_path)
    batch = _step(runner, new=[_request("greedy", temperature=0.0), _request("sampled", temperature=0.8)])
    drafts = [2 if req_id == "greedy" else 3 for req_id in batch.req_ids]
    batch = _spec_batch(batch, drafts)
    num_rows = sum(drafts) + 2
    hidden_states = torch.randn(batch.input_ids.numel(), HIDDEN)  # every token of the step
    hidden = hidden_states[batch.logits_indices]

    runner.sample(hidden_states, batch, None)  # builds the head, as the profile run does
    logits = runner.sampler.seen_logits
    reference = controller.compute_logits(  # the same rows served without speculation
        hidden, model_runner_v2.step_rows(runner.sampler, batch), lambda h: h @ lm_head.weight.T, lambda x: x
    )
    rows = model_runner_v2.runner_step_rows(runner, runner.sampler, batch)
    for row in rows.verify_rows.tolist():
        torch.testing.assert_close(logits[row], reference[row])  # FlashHead's row, as without speculation
    greedy_rows = np.flatnonzero(~rows.sampled)
    assert all(0 < int(torch.isfinite(logits[r]).sum()) < VOCAB // 2 for r in greedy_rows)  # candidates only
    counters = controller.counters
    assert counters.rows_flashhead == 2 * num_rows  # the step and the reference call
    assert counters.rows_flashhead_verify == sum(drafts)
    assert controller.status().spec.verify.active


def test_v2_steps_laid_out_on_the_device_are_dense_and_the_status_says_so(v2, tmp_path, flashhead_hooks):
    runner, controller, lm_head = _spec_runner(v2, tmp_path)
    batch = _spec_batch(_step(runner, new=[_request("a", temperature=0.0), _request("b", temperature=0.5)]), [2, 1])
    hidden_states = torch.randn(batch.input_ids.numel(), HIDDEN)
    dense = hidden_states[batch.logits_indices] @ lm_head.weight.T

    wrong = dataclasses.replace(batch, cu_num_logits_np=np.array([0, 2, 5], dtype=np.int32))  # 1 + 3 rows
    runner.sample(hidden_states, wrong, None)
    torch.testing.assert_close(runner.sampler.seen_logits, dense)
    assert controller.counters.rows_dense == {"unexpected_rows": 5}
    assert controller.status().spec.verify.active  # one odd step says nothing of the next

    runner.adaptive_verification = object()  # drafts reallocated on the device only
    runner.sample(hidden_states, batch, None)
    torch.testing.assert_close(runner.sampler.seen_logits, dense)
    assert controller.counters.rows_dense["speculative_verify"] == 5 and controller.counters.rows_flashhead == 0
    status = controller.status().spec
    assert not status.verify.active and status.verify.reason_code == "model_runner_v2"
    assert "on the device" in status.verify.reason


def test_v2_steps_that_sample_several_new_tokens_per_request_are_dense(v2, tmp_path, flashhead_hooks):
    runner, controller, lm_head = _spec_runner(v2, tmp_path)
    runner.model_state.num_new_sampled_tokens_per_step = 2
    batch = _spec_batch(_step(runner, new=[_request("a", temperature=0.0)]), [1])
    rows = model_runner_v2.runner_step_rows(runner, runner.sampler, batch)
    assert rows.all_dense == "speculative_verify"
    status = controller.status().spec
    assert status.verify.reason_code == "model_runner_v2" and "several new tokens" in status.verify.reason


def _install_hooks(monkeypatch, *, building: bool = True):
    """`patches.on_flashhead_model()` in a worker building the model (a vLLM config is current) or
    elsewhere, with vLLM's `LogitsProcessor` registry taken back afterwards."""
    import contextlib

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.custom_op import op_registry_oot

    monkeypatch.setitem(op_registry_oot, "LogitsProcessor", None)
    op_registry_oot.pop("LogitsProcessor")
    with set_current_vllm_config(VllmConfig()) if building else contextlib.nullcontext():
        patches.on_flashhead_model()
    return op_registry_oot


def test_a_process_that_builds_no_model_gets_only_the_logits_processor(v2, monkeypatch):
    """vLLM's model-inspection subprocess resolves the architecture too, with no config: no runner import."""
    tried = []
    monkeypatch.setattr(model_runner, "apply", lambda: tried.append("V1"))
    monkeypatch.setattr(model_runner_v2, "apply", lambda: tried.append("V2"))
    registry = _install_hooks(monkeypatch, building=False)
    assert registry["LogitsProcessor"] is logits_processor.subclass() and tried == []
    _install_hooks(monkeypatch)
    assert tried == ["V1", "V2"]


@pytest.mark.parametrize("use_v2", [True, False], ids=["V2", "V1"])
def test_one_entry_installs_every_hook_and_the_runner_vllm_uses_decides(use_v2, v2, tmp_path, monkeypatch):
    """`on_flashhead_model` installs the logits processor and both runners' hooks; a failed hook
    makes FlashHead unavailable only when vLLM runs that runner."""
    unused = model_runner if use_v2 else model_runner_v2

    def broken():
        raise AttributeError("moved")

    monkeypatch.setattr(unused, "apply", broken)
    registry = _install_hooks(monkeypatch)
    assert registry["LogitsProcessor"] is logits_processor.subclass()
    assert patches.hook_error("model_runner_v2" if use_v2 else "model_runner") is None
    assert patches.hook_error("model_runner" if use_v2 else "model_runner_v2") == "moved"
    assert _processor(tmp_path, _lm_head(), use_v2=use_v2)._my_pkg_flashhead.available
    status = _processor(tmp_path, _lm_head(), use_v2=not use_v2)._my_pkg_flashhead.status()
    assert not status.available and status.reason_code == "runner_hook_failed" and "moved" in status.reason


def test_a_missing_v2_symbol_leaves_flashhead_unavailable_not_a_crash(v2, tmp_path, monkeypatch):
    monkeypatch.delattr(v2.GPUModelRunner, "sample")
    _install_hooks(monkeypatch)
    processor = _processor(tmp_path, _lm_head())
    status = processor._my_pkg_flashhead.status()
    assert not status.available and status.reason_code == "runner_hook_failed"
    assert "Model Runner V2" in status.reason and "GPUModelRunner.sample is missing" in status.reason
    assert not getattr(v2.Sampler.add_request, "_my_pkg_wrapped", False)  # nothing half-applied


def test_vllms_config_reports_the_runner_it_picks(monkeypatch):
    """The flag the hook choice reads is VllmConfig's own (`VLLM_USE_V2_MODEL_RUNNER` decides when set)."""
    from vllm.config import VllmConfig

    assert isinstance(VllmConfig.use_v2_model_runner, property)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert VllmConfig().use_v2_model_runner is False


def test_a_model_built_after_an_earlier_resolution_without_config_still_gets_its_runner_hooked(
    v2, tmp_path, monkeypatch
):
    """vLLM caches a resolved architecture: if a process resolved it before any config was current,
    building the model (under its config) installs the runner hooks through the same entry."""
    monkeypatch.setattr(patches, "_hook_errors", {})
    _install_hooks(monkeypatch, building=False)
    assert patches.hook_error("model_runner_v2") is not None  # not tried in that process yet
    processor = _processor(tmp_path, _lm_head(), use_v2=True)
    assert processor._my_pkg_flashhead.available and patches.hook_error("model_runner_v2") is None
    assert getattr(v2.GPUModelRunner.sample, "_my_pkg_wrapped", False)
