"""FlashHead under speculative decoding (V1; V2's layout is in test_model_runner_v2.py): the rows of a step
against vLLM's own layout, the draft token scored exactly on sampled verify rows only, the per-part status,
and the fallbacks."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from my_pkg.contract import FlashHeadState
from my_pkg.engine import patches
from my_pkg.engine import setup as engine_setup
from my_pkg.engine.flashhead import FlashHeadController, StepRows
from my_pkg.engine.flashhead.rows import DenseReason
from my_pkg.engine.flashhead.spec import spec_state
from my_pkg.engine.patches import model_runner, runner_hooks

VOCAB, HIDDEN, CAP = 256, 16, 16
NGRAM = SimpleNamespace(method="ngram", num_speculative_tokens=3, draft_sample_method="greedy")
DRAFT_MODEL = SimpleNamespace(method="draft_model", num_speculative_tokens=3, draft_sample_method="greedy")


def _fake_runner(num_reqs: int, temperatures, dense: dict[str, int], speculative_config=NGRAM):
    """What the hooks read of vLLM's V1 runner, with vLLM's own `_calc_spec_decode_metadata` bound to it."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    batch = SimpleNamespace(
        num_reqs=num_reqs,
        req_id_to_index={f"r{i}": i for i in range(num_reqs)},
        temperature_cpu=np.asarray(temperatures, dtype=np.float32),
        logitsprocs=SimpleNamespace(all=[]),
    )
    batch.__dict__["_my_pkg_dense_requests"] = dense
    runner = SimpleNamespace(
        input_batch=batch,
        speculative_config=speculative_config,
        arange_np=np.arange(1024),
        _arange_scratch=np.empty(1024, dtype=np.int64),
        device=torch.device("cpu"),
        input_ids=SimpleNamespace(gpu=torch.randint(0, VOCAB, (512,), generator=torch.Generator().manual_seed(1))),
    )
    runner._get_cumsum_and_arange = functools.partial(GPUModelRunner._get_cumsum_and_arange, runner)
    return runner


def _calc(runner, num_draft_tokens, num_scheduled_tokens):
    """vLLM's `_calc_spec_decode_metadata` (hooked), as `_prepare_inputs` calls it."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    n = np.asarray(num_draft_tokens, dtype=np.int32)
    cu = np.cumsum(np.asarray(num_scheduled_tokens, dtype=np.int32))
    return GPUModelRunner._calc_spec_decode_metadata(runner, n, cu)


def test_rows_follow_vllms_own_spec_decode_layout(flashhead_hooks):
    # vLLM's documented example: 5 requests with 3, 0, 2, 0, 1 drafts.
    assert model_runner.spec_hook_error() is None
    runner = _fake_runner(5, [0.0, 0.7, 0.0, 1.0, 0.5], {"r2": DenseReason.LOGPROBS})
    metadata = _calc(runner, [3, 0, 2, 0, 1], [4, 100, 3, 100, 2])
    rows = model_runner.runner_step_rows(runner)
    assert rows.num_rows == int(metadata.logits_indices.shape[0]) == 11
    assert rows.verify_rows.tolist() == metadata.target_logits_indices.tolist() == [0, 1, 2, 5, 6, 9]
    bonus = sorted(set(range(11)) - set(rows.verify_rows.tolist()))
    assert bonus == metadata.bonus_logits_indices.tolist()
    assert rows.dense_codes.tolist() == [0] * 5 + [DenseReason.LOGPROBS] * 3 + [0] * 3
    assert rows.sampled.tolist() == [False] * 4 + [True] + [False] * 3 + [True] * 3


def test_the_stash_is_per_step(flashhead_hooks):
    runner = _fake_runner(2, [0.7, 0.7], {}, SimpleNamespace(method="eagle", draft_sample_method="probabilistic"))
    _calc(runner, [2, 1], [3, 2])
    rows = model_runner.runner_step_rows(runner)
    assert rows.num_rows == 5 and rows.verify_rows.tolist() == [0, 1, 3]
    runner.__dict__.pop(model_runner._SPEC_STASH)  # what the execute_model hook does at every step
    assert model_runner.runner_step_rows(runner).num_rows == 2  # no metadata: one row per request


def test_a_mismatched_draft_count_serves_the_step_dense_with_a_reason():
    per_request = StepRows(np.zeros(3, np.uint8), np.zeros(3, bool))
    rows = runner_hooks.spec_step_rows(per_request, np.array([1, 2]))
    assert rows.all_dense == "unexpected_rows"


def test_without_the_metadata_hook_speculative_steps_are_dense(monkeypatch):
    monkeypatch.setitem(patches._hook_errors, patches.SPEC_METADATA_HOOK, "moved")
    rows = model_runner.runner_step_rows(_fake_runner(2, [0.0, 0.0], {}))
    assert rows.all_dense == "speculative_verify"
    assert model_runner.runner_step_rows(_fake_runner(2, [0.0, 0.0], {}, None)).all_dense is None


# ---- the controller: greedy rows unchanged, sampled verify rows with their draft exact ------------


@pytest.fixture
def controller():
    torch.manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN)
    assignments = torch.randperm(VOCAB) % (VOCAB // CAP)
    centroids = torch.stack([weight[assignments == c].mean(0) for c in range(VOCAB // CAP)])
    controller = FlashHeadController(
        centroids=centroids, assignments=assignments, config={"n_probes": 2}, vocab_size=VOCAB
    )
    controller.prepare(weight)
    assert controller.head is not None
    return controller


def _serve(controller, hidden, rows):
    dense = lambda h: h @ controller.head.weight.T  # noqa: E731
    return controller.compute_logits(hidden, rows, dense, lambda x: x)


def _outside_candidates(logits_row: torch.Tensor) -> int:
    """A token the row's FlashHead logits do not score exactly (-inf for a greedy row)."""
    return int(torch.nonzero(~torch.isfinite(logits_row))[0, 0])


def test_verify_rows_are_served_as_without_speculation(controller):
    """Greedy and sampled verify and bonus rows are FlashHead's rows without speculation (vLLM's rejection sampler
    then emits FlashHead's own law, whatever the drafter proposed); a request that needs exact logits gets them on
    all its rows."""
    # Request 0 greedy with 2 drafts, request 1 sampled with 3, request 2 sampled but needs dense (1 draft).
    per_request = StepRows(np.array([0, 0, DenseReason.LOGPROBS], np.uint8), np.array([False, True, True]))
    n = np.array([2, 3, 1])
    hidden = torch.randn(int((n + 1).sum()), HIDDEN)
    dense = hidden @ controller.head.weight.T
    plain = StepRows(np.zeros(9, np.uint8), np.array([False] * 3 + [True] * 4 + [False] * 2))
    reference = _serve(controller, hidden, plain)  # each row alone, without speculation
    rows = runner_hooks.spec_step_rows(per_request, n)
    assert rows.verify_rows.tolist() == [0, 1, 3, 4, 5, 7]
    before = controller.counters.snapshot()
    logits = _serve(controller, hidden, rows)
    torch.testing.assert_close(logits[:7], reference[:7])
    torch.testing.assert_close(logits[7:], dense[7:])  # the dense request, verify and bonus
    after = controller.counters.snapshot()
    assert after.rows_flashhead - before.rows_flashhead == 7
    assert after.rows_flashhead_verify - before.rows_flashhead_verify == 5
    assert after.rows_dense["logprobs"] - before.rows_dense.get("logprobs", 0) == 2


def test_steps_the_hooks_mark_dense_and_wrong_row_counts_are_counted(controller):
    hidden = torch.randn(4, HIDDEN)
    dense = hidden @ controller.head.weight.T
    marked = StepRows(np.zeros(4, np.uint8), np.zeros(4, bool), all_dense="speculative_verify")
    torch.testing.assert_close(_serve(controller, hidden, marked), dense)
    short = runner_hooks.spec_step_rows(StepRows(np.zeros(1, np.uint8), np.zeros(1, bool)), np.array([2]))
    torch.testing.assert_close(_serve(controller, hidden, short), dense)  # 3 rows announced, 4 came
    assert controller.counters.rows_dense == {"speculative_verify": 4, "unexpected_rows": 4}
    assert controller.counters.rows_flashhead == 0


# ---- the status route: one reason code per part -----------------------------------------------


@pytest.mark.parametrize(
    ("config", "v2", "hook_error", "verify", "draft"),
    [
        (NGRAM, False, None, None, "no_draft_head"),
        (SimpleNamespace(method="suffix", num_speculative_tokens=4), False, None, None, "no_draft_head"),
        (SimpleNamespace(method="eagle3", num_speculative_tokens=3), False, None, None, "draft_not_loaded"),
        (SimpleNamespace(method="eagle", num_speculative_tokens=2), True, None, None, "model_runner_v2"),
        (SimpleNamespace(method="medusa", num_speculative_tokens=2), False, None, None, "draft_head_not_supported"),
        (SimpleNamespace(method="mtp", num_speculative_tokens=1), False, None, None, "draft_head_not_supported"),
        (DRAFT_MODEL, False, None, None, "draft_not_loaded"),  # decided when the drafter loads (test_spec_draft)
        (DRAFT_MODEL, True, None, None, "model_runner_v2"),
        (NGRAM, True, None, None, "no_draft_head"),
        (NGRAM, True, "moved", None, "no_draft_head"),  # V2 verifies without V1's metadata hook
        (NGRAM, False, "moved", "spec_hook_failed", "no_draft_head"),
    ],
)
def test_each_part_has_its_own_reason_code(config, v2, hook_error, verify, draft):
    state = spec_state(config, v2=v2, hook_error=hook_error)
    assert state.verify.active is (verify is None) and state.verify.reason_code == verify
    assert not state.draft.active and state.draft.reason_code == draft and state.draft.reason
    assert state.method == config.method and "pin_drafts" not in state.model_dump()
    assert spec_state(None, v2=v2, hook_error=hook_error) is None


def test_a_draft_models_part_says_when_the_drafter_could_not_be_hooked():
    state = spec_state(DRAFT_MODEL, v2=False, hook_error=None, draft_hook_error="moved")
    assert state.verify.active and state.draft.reason_code == "draft_hook_failed" and "moved" in state.draft.reason
    assert spec_state(NGRAM, v2=False, hook_error=None, draft_hook_error="moved").draft.reason_code == "no_draft_head"


def test_the_status_shows_the_parts_and_no_part_is_active_while_flashhead_is_not(controller):
    controller.spec = spec_state(NGRAM, v2=False, hook_error=None)
    state = FlashHeadState.model_validate(controller.status().model_dump())
    assert state.active and state.reason_code is None
    assert state.spec.verify.active and state.spec.draft.reason_code == "no_draft_head"
    controller.settings.enabled = False
    off = controller.status()
    assert off.reason_code == "disabled" and not off.spec.verify.active
    assert off.spec.verify.reason_code == "flashhead_inactive" and off.spec.draft.reason_code == "no_draft_head"


def test_speculative_decoding_no_longer_turns_flashhead_off():

    config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(dtype=torch.bfloat16, head_dtype=None),
        speculative_config=NGRAM,
        lora_config=None,
    )
    assert engine_setup.unsupported_reason(config) is None


def test_a_drafter_being_built_is_told_apart_from_the_target():
    from vllm.compilation.backends import set_model_tag

    assert not engine_setup.building_drafter()
    for tag in ("eagle_head", "draft_model"):
        with set_model_tag(tag):
            assert engine_setup.building_drafter()


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_vllms_rejection_sampler_emits_flashheads_own_law_whatever_the_draft(controller, seed):
    """vLLM's real rejection sampler (CPU kernels) on a sampled verify row whose draft token FlashHead only estimated
    (chosen so by construction: the likeliest such token): the emitted law is the row's FlashHead law, as without
    speculation."""
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import rejection_sample

    current_platform.register_triton_kernel_overrides()  # as vLLM's CPU worker does: its C++ kernels
    torch.manual_seed(seed)
    hidden = torch.randn(2, HIDDEN) * 3
    dense = hidden @ controller.head.weight.T
    unpinned = _serve(controller, hidden, StepRows(np.zeros(2, np.uint8), np.ones(2, bool)))[0]
    outside = torch.where(torch.isclose(unpinned, dense[0]), torch.full_like(dense[0], -torch.inf), dense[0])
    d = int(outside.argmax())
    assert not torch.isclose(unpinned[d], dense[0, d])  # the draft is not scored exactly, by construction
    rows = runner_hooks.spec_step_rows(StepRows(np.zeros(1, np.uint8), np.ones(1, bool)), np.array([1]))
    verify = _serve(controller, hidden, rows)[0]
    torch.testing.assert_close(verify, unpinned)
    law = unpinned.float().softmax(-1)

    draws = 40_000
    metadata = SimpleNamespace(all_greedy=False, all_random=True, temperature=torch.ones(draws), generators={})
    out = rejection_sample(
        torch.full((draws,), d, dtype=torch.int32),
        [1] * draws,
        1,
        torch.arange(1, draws + 1, dtype=torch.int32),
        None,
        verify.float().expand(draws, -1).contiguous(),
        torch.zeros((draws, 1), dtype=torch.int32),
        metadata,
    )
    emitted = torch.bincount(out[:, 0].long(), minlength=VOCAB).float() / draws
    sigma = float((law[d] * (1 - law[d]) / draws).sqrt())
    assert abs(float(emitted[d] - law[d])) < 5 * sigma + 1e-4
    assert 0.5 * float((emitted - law).abs().sum()) < 0.05
