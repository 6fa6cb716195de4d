"""The per-worker FlashHead controller: per-row semantics, thresholds, control, counters."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from my_pkg.contract import FlashHeadState, FlashHeadUpdate
from my_pkg.engine.flashhead import FlashHeadController, status_without_controller
from my_pkg.engine.flashhead.rows import DenseReason, StepRows
from my_pkg.flashhead.step_costs import StepCosts

VOCAB, HIDDEN, CAP = 512, 32, 16
CLUSTERS = VOCAB // CAP


@pytest.fixture
def weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(VOCAB + 8, HIDDEN)  # vLLM pads the head's rows


@pytest.fixture
def controller(weight, monkeypatch) -> FlashHeadController:
    for name in ("MY_PKG_FLASHHEAD", "MY_PKG_FLASHHEAD_N_PROBES", "MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD"):
        monkeypatch.delenv(name, raising=False)
    assignments = torch.randperm(VOCAB) % CLUSTERS
    centroids = torch.stack([weight[:VOCAB][assignments == c].mean(0) for c in range(CLUSTERS)])
    ctl = FlashHeadController(
        centroids=centroids,
        assignments=assignments,
        config={"n_probes": 4},
        vocab_size=VOCAB,
    )
    ctl.bind(weight)
    return ctl


def _dense(weight):
    return lambda hidden: hidden @ weight[:VOCAB].T


def _rows(codes, sampled=None) -> StepRows:
    codes = np.asarray(codes, dtype=np.uint8)
    return StepRows(codes, np.zeros(len(codes), bool) if sampled is None else np.asarray(sampled))


def test_plain_rows_get_exact_candidate_logits_and_minus_inf_elsewhere(controller, weight):
    hidden = torch.randn(3, HIDDEN)
    logits = controller.compute_logits(hidden, _rows([0, 0, 0]), _dense(weight), lambda x: x)
    dense = _dense(weight)(hidden)
    finite = torch.isfinite(logits)
    assert (finite.sum(1) >= CAP).all() and (finite.sum(1) <= 4 * CAP).all()
    torch.testing.assert_close(logits[finite], dense[finite])
    assert controller.counters.rows_flashhead == 3
    assert controller.counters.steps == 1


def test_rows_that_need_dense_get_vllm_logits_and_are_counted_by_reason(controller, weight):
    hidden = torch.randn(4, HIDDEN)
    codes = [0, DenseReason.LOGPROBS, 0, DenseReason.STRUCTURED_OUTPUT]
    logits = controller.compute_logits(hidden, _rows(codes), _dense(weight), lambda x: x)
    dense = _dense(weight)(hidden)
    torch.testing.assert_close(logits[1], dense[1])
    torch.testing.assert_close(logits[3], dense[3])
    for row in (0, 2):  # FlashHead rows: exact on their own candidates, -inf elsewhere
        finite = torch.isfinite(logits[row])
        assert CAP <= int(finite.sum()) <= 4 * CAP
        torch.testing.assert_close(logits[row][finite], dense[row][finite])
        alone = controller.compute_logits(hidden[row : row + 1], _rows([0]), _dense(weight), lambda x: x)
        assert torch.equal(torch.isfinite(alone[0]), finite)
    assert controller.counters.rows_flashhead == 4
    assert controller.counters.rows_dense == {"logprobs": 1, "structured_output": 1}


def test_postprocess_applies_to_candidates_only(controller, weight):
    hidden = torch.randn(2, HIDDEN)
    logits = controller.compute_logits(hidden, _rows([0, 0]), _dense(weight), lambda x: torch.tanh(x / 2) * 2)
    finite = torch.isfinite(logits)
    assert logits[finite].abs().max() <= 2.0
    assert (logits[~finite] == float("-inf")).all()


def test_every_cluster_probed_equals_dense(controller, weight):
    controller.apply(FlashHeadUpdate(n_probes=CLUSTERS))
    hidden = torch.randn(5, HIDDEN)
    logits = controller.compute_logits(hidden, _rows([0] * 5), _dense(weight), lambda x: x)
    torch.testing.assert_close(logits, _dense(weight)(hidden))


def test_batch_above_threshold_and_disabled_go_dense(controller, weight):
    hidden = torch.randn(3, HIDDEN)
    controller.apply(FlashHeadUpdate(dense_batch_threshold=2))
    out = controller.compute_logits(hidden, _rows([0, 0, 0]), _dense(weight), lambda x: x)
    torch.testing.assert_close(out, _dense(weight)(hidden))
    controller.apply(FlashHeadUpdate(dense_batch_threshold=64, enabled=False))
    controller.compute_logits(hidden, _rows([0, 0, 0]), _dense(weight), lambda x: x)
    assert controller.counters.rows_dense == {"batch_threshold": 3, "disabled": 3}
    assert controller.counters.rows_flashhead == 0
    status = controller.status()
    assert status.active is False and status.reason_code == "disabled" and "disabled" in status.reason


def test_sampled_rows_get_estimated_logits_and_stay_reproducible(controller, weight):
    controller.apply(FlashHeadUpdate(dense_batch_threshold=64))
    torch.manual_seed(1)
    hidden = torch.randn(1, HIDDEN).repeat(8, 1)
    greedy = controller.compute_logits(hidden, _rows([0] * 8), _dense(weight), lambda x: x)
    sampled = controller.compute_logits(hidden, _rows([0] * 8, [True] * 8), _dense(weight), lambda x: x)
    assert controller.counters.rows_flashhead == 16
    assert not torch.isfinite(greedy).all()
    assert torch.isfinite(sampled).all()  # unprobed clusters keep an estimated share of the mass
    assert (sampled == sampled[0]).all()  # nothing random: a seeded request reproduces
    status = controller.status()
    assert status.sampled_n_probes == controller.head.sampled_n_probes == 0  # the estimate chooses the exact tokens
    assert status.sampled_rescore == controller.head.sampled_rescore > 0
    exact = torch.isclose(sampled[0], _dense(weight)(hidden[:1])[0], rtol=1e-5, atol=1e-5)
    assert int(exact.sum()) >= status.sampled_rescore
    controller.settings.probe_sampling = False  # MY_PKG_FLASHHEAD_PROBE_SAMPLING=0
    plain = controller.compute_logits(hidden, _rows([0] * 8, [True] * 8), _dense(weight), lambda x: x)
    assert torch.equal(plain, greedy)
    status = controller.status()
    assert status.sampled_n_probes == status.n_probes and status.sampled_rescore is None


def test_mismatched_rows_go_dense(controller, weight):
    hidden = torch.randn(3, HIDDEN)
    out = controller.compute_logits(hidden, _rows([0, 0]), _dense(weight), lambda x: x)
    torch.testing.assert_close(out, _dense(weight)(hidden))
    assert controller.counters.rows_dense == {"unexpected_rows": 3}


def test_an_update_is_checked_against_the_served_model_only(controller):
    """The contract checks fields and types (`FlashHeadUpdate`); the controller what the model decides."""
    before = controller.status()
    errors = controller.validate(FlashHeadUpdate(n_probes=CLUSTERS + 1))
    assert errors == [f"n_probes must be <= the number of clusters ({CLUSTERS})"]
    assert controller.validate(FlashHeadUpdate(n_probes=CLUSTERS, enabled=False, dense_batch_threshold=None)) == []
    assert controller.status() == before


def test_status_is_the_contract_model_with_every_field_set(controller, weight):
    """No field of `FlashHeadState` is left to its default, with or without a controller."""
    every = set(FlashHeadState.model_fields)
    built = controller.status()
    assert isinstance(built, FlashHeadState) and built.model_fields_set == every
    unbuilt = FlashHeadController(centroids=None, assignments=None, config={}, vocab_size=VOCAB).status()
    assert unbuilt.model_fields_set == every and unbuilt.reason_code == "no_assets"
    missing = status_without_controller()
    assert missing.model_fields_set == every and missing.reason_code == "no_assets"
    taken = status_without_controller("logits_processor_taken", "another plugin")
    assert taken.reason == "another plugin" and not taken.available


def test_extra_memory_covers_the_sampled_rows_tables_and_pins(weight):
    ctl = _pinned_controller(weight, [3, 7])
    assert ctl.head is not None and ctl.head.estimate.built is not None  # built by `prepare`, before any request
    memory = ctl.status().extra_memory_bytes
    assert memory >= ctl.head.extra_memory_bytes + 2 * HIDDEN * weight.element_size()
    assert memory > ctl.head.centroids.numel() * ctl.head.centroids.element_size() + ctl.head.estimate.built.nbytes


def test_extra_memory_counts_the_linked_drafters_head_too(weight, controller):
    alone = controller.status().extra_memory_bytes
    drafter = _pinned_controller(weight, [3])
    controller.draft = drafter
    assert controller.status().extra_memory_bytes == alone + drafter.extra_memory_bytes


def test_a_drafters_head_sharing_the_targets_copy_of_its_rows_counts_it_once(weight):
    target = _pinned_controller(weight, [3])
    alone = target.status().extra_memory_bytes
    drafter = _pinned_controller(weight, [3])  # an EAGLE drafter's head: the same LM head, the same assets
    assert drafter.head.cluster_rows is target.head.cluster_rows
    target.draft = drafter
    assert target.status().extra_memory_bytes == alone + drafter.extra_memory_bytes - drafter.head.cluster_rows.nbytes


def test_cluster_rows_off_builds_the_head_without_its_copy(weight, monkeypatch):
    copied = _pinned_controller(weight, [3])
    assert copied.head.cluster_rows is not None
    monkeypatch.setenv("MY_PKG_FLASHHEAD_CLUSTER_ROWS", "0")
    direct = _pinned_controller(weight, [3])
    assert direct.head.cluster_rows is None
    assert direct.status().extra_memory_bytes < copied.status().extra_memory_bytes - VOCAB * HIDDEN * 4
    hidden = torch.randn(3, HIDDEN)
    rows = _rows([0, 0, 0], sampled=[False, True, False])
    same = [ctl.compute_logits(hidden, rows, _dense(weight), lambda x: x) for ctl in (copied, direct)]
    assert torch.equal(*same)


def test_apply_takes_effect_on_the_head(controller):
    controller.apply(FlashHeadUpdate(n_probes=7))
    assert controller.head.n_probes == 7
    assert controller.status().n_probes == 7


def test_fallback_is_counted_and_logged_once(controller, caplog):
    error = RuntimeError("kernel exploded")
    controller.record_fallback(error, 4)
    controller.record_fallback(error, 4)
    assert controller.counters.fallbacks == 2
    assert controller.counters.rows_dense["error"] == 8
    assert sum("kernel exploded" in r.getMessage() for r in caplog.records) == 1


def test_assets_that_do_not_match_the_vocabulary_leave_it_unavailable(weight):
    ctl = FlashHeadController(
        centroids=torch.randn(4, HIDDEN),
        assignments=torch.zeros(10, dtype=torch.long),
        config={},
        vocab_size=VOCAB,
    )
    ctl.bind(weight)
    assert ctl.head is None and not ctl.available
    assert "vocabulary" in ctl.status().reason
    assert ctl.validate(FlashHeadUpdate(n_probes=1))


def test_environment_sets_start_up_settings(weight, monkeypatch):
    monkeypatch.setenv("MY_PKG_FLASHHEAD", "0")
    monkeypatch.setenv("MY_PKG_FLASHHEAD_N_PROBES", "3")
    monkeypatch.setenv("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", "9")
    ctl = FlashHeadController(
        centroids=torch.randn(CLUSTERS, HIDDEN),
        assignments=torch.randperm(VOCAB) % CLUSTERS,
        config={"n_probes": 5},
        vocab_size=VOCAB,
    )
    assert (ctl.settings.enabled, ctl.settings.n_probes, ctl.settings.dense_batch_threshold) == (False, 3, 9)


def test_settings_can_change_before_the_head_is_built(weight):
    ctl = FlashHeadController(
        centroids=torch.randn(CLUSTERS, HIDDEN),
        assignments=torch.randperm(VOCAB) % CLUSTERS,
        config={"n_probes": 5},
        vocab_size=VOCAB,
    )
    assert ctl.head is None
    assert ctl.status().num_clusters == CLUSTERS and ctl.status().cluster_size == CAP
    assert ctl.validate(FlashHeadUpdate(n_probes=CLUSTERS)) == []
    assert ctl.validate(FlashHeadUpdate(n_probes=CLUSTERS + 1))
    ctl.apply(FlashHeadUpdate(n_probes=CLUSTERS))
    ctl.bind(weight)
    assert ctl.head.n_probes == CLUSTERS


def _pinned_controller(weight, pinned, n_probes=1):
    assignments = torch.arange(VOCAB) // CAP  # token t lives in cluster t // CAP
    centroids = torch.stack([weight[:VOCAB][assignments == c].mean(0) for c in range(CLUSTERS)])
    ctl = FlashHeadController(
        centroids=centroids, assignments=assignments, config={"n_probes": n_probes}, vocab_size=VOCAB, pinned_ids=pinned
    )
    ctl.prepare(weight)
    return ctl


def _hidden_far_from_cluster_of(weight, token):
    """Hidden states whose dense argmax is `token`, while the best centroid is another cluster's."""
    torch.manual_seed(1)
    for _ in range(2000):
        hidden = torch.randn(1, HIDDEN) * 3
        scores = hidden @ weight[:VOCAB].T
        centroid_best = int(
            (
                hidden @ torch.stack([weight[:VOCAB][c * CAP : (c + 1) * CAP].mean(0) for c in range(CLUSTERS)]).T
            ).argmax()
        )
        if int(scores.argmax()) == token and centroid_best != token // CAP:
            return hidden
    raise AssertionError("no such hidden state")


def test_eos_and_special_tokens_are_scored_on_every_row(weight):
    hidden = _hidden_far_from_cluster_of(weight, int((torch.randn(1, HIDDEN) @ weight[:VOCAB].T).argmax()))
    eos = int((hidden @ weight[:VOCAB].T).argmax())
    unpinned = _pinned_controller(weight, [])
    assert int(unpinned.compute_logits(hidden, _rows([0]), _dense(weight), lambda x: x).argmax()) != eos
    pinned = _pinned_controller(weight, [eos, VOCAB + 3])  # ids outside the vocabulary are ignored
    logits = pinned.compute_logits(hidden, _rows([0]), _dense(weight), lambda x: x)
    assert int(logits.argmax()) == eos  # FlashHead stops where dense stops
    torch.testing.assert_close(logits[0, eos], (hidden @ weight[:VOCAB].T)[0, eos])
    assert pinned.status().pinned_token_ids == [eos]


def test_a_requests_stop_token_ids_are_scored_on_every_flashhead_row(weight):
    hidden = _hidden_far_from_cluster_of(weight, int((torch.randn(1, HIDDEN) @ weight[:VOCAB].T).argmax()))
    stop = int((hidden @ weight[:VOCAB].T).argmax())
    ctl = _pinned_controller(weight, [])
    both = torch.cat([hidden, hidden])
    rows = StepRows(np.array([0, DenseReason.LOGPROBS], np.uint8), np.zeros(2, bool), stop_ids=(stop,))
    logits = ctl.compute_logits(both, rows, _dense(weight), lambda x: x)
    assert logits.argmax(1).tolist() == [stop, stop]
    torch.testing.assert_close(logits[1], (hidden @ weight[:VOCAB].T)[0])  # the dense row is untouched


def test_stop_and_special_token_ids_come_from_the_model_files(tmp_path):
    import json

    from my_pkg.flashhead.assets import stop_and_special_token_ids

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "added_tokens_decoder": {
                    "0": {"content": "<unk>", "special": True},
                    "5": {"content": "<|user|>", "special": True},
                    "9": {"content": "word", "special": False},
                }
            }
        )
    )
    assert stop_and_special_token_ids(tmp_path, {"eos_token_id": 3}) == [0, 2, 3, 5, 7]
    assert stop_and_special_token_ids(tmp_path / "missing", {"text_config": {"eos_token_id": [4]}}) == [4]


def test_live_fidelity_telemetry_checks_one_row_in_n_against_the_dense_head(weight, monkeypatch):
    monkeypatch.setenv("MY_PKG_FLASHHEAD_FIDELITY_EVERY", "4")
    ctl = _pinned_controller(weight, [], n_probes=1)
    assert ctl.status().fidelity_every == 4
    torch.manual_seed(2)
    for _ in range(8):  # 24 FlashHead rows: 6 checked
        ctl.compute_logits(torch.randn(3, HIDDEN) * 3, _rows([0, 0, 0]), _dense(weight), lambda x: x)
    counters = ctl.status().counters
    assert counters.fidelity_rows == 6
    assert 0 <= counters.fidelity_agreed < 6  # one probe of 32 clusters misses some argmaxes

    ctl.apply(FlashHeadUpdate(n_probes=CLUSTERS))  # every cluster probed: FlashHead is the dense head
    for _ in range(4):
        ctl.compute_logits(torch.randn(3, HIDDEN) * 3, _rows([0, 0, 0]), _dense(weight), lambda x: x)
    after = ctl.status().counters
    assert after.fidelity_rows == 9 and after.fidelity_agreed - counters.fidelity_agreed == 3


def test_live_fidelity_sums_each_checked_sampled_rows_distance_from_the_dense_law(weight, monkeypatch):
    from my_pkg.engine.flashhead.telemetry import total_variation

    monkeypatch.setenv("MY_PKG_FLASHHEAD_FIDELITY_EVERY", "1")
    ctl = _pinned_controller(weight, [], n_probes=1)
    torch.manual_seed(3)
    hidden, sampled = torch.randn(4, HIDDEN) * 3, [True, False, True, True]
    logits = ctl.compute_logits(hidden, _rows([0, 0, 0, 0], sampled), _dense(weight), lambda x: x)
    counters = ctl.status().counters
    assert counters.fidelity_rows == 4 and counters.fidelity_sampled_rows == 3  # greedy rows have no law to compare
    expected = total_variation(logits[[0, 2, 3]].float(), _dense(weight)(hidden)[[0, 2, 3]].float()).sum()
    assert 0 < counters.fidelity_tv_sum == pytest.approx(float(expected), abs=1e-5)
    assert counters.fidelity_tv_sum <= 3  # a distance is at most 1 per row

    same = torch.zeros(2, 10)  # equal laws are at distance 0; disjoint supports at 1
    assert total_variation(same, same).tolist() == [0.0, 0.0]
    apart = torch.tensor([[0.0, float("-inf")], [float("-inf"), 0.0]])
    assert total_variation(apart, apart.flip(0)).tolist() == [1.0, 1.0]


def test_fidelity_telemetry_off(weight, monkeypatch):
    monkeypatch.setenv("MY_PKG_FLASHHEAD_FIDELITY_EVERY", "0")
    ctl = _pinned_controller(weight, [])
    calls = []
    dense = _dense(weight)
    ctl.compute_logits(torch.randn(5, HIDDEN), _rows([0] * 5), lambda h: calls.append(h) or dense(h), lambda x: x)
    assert calls == [] and ctl.status().counters.fidelity_rows == 0


# ---- no host synchronisation on the step path -------------------------------------------------


class _NoHostWait(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on any op that makes the host wait for the device: reading a value back (`.item()`,
    `bool(t)`, `int(t)`), an op whose output shape depends on the data, or a copy between devices that
    is not non_blocking. On CPU there is no second device, so `torch.tensor(..., device=...)` (a
    pageable, blocking upload on an accelerator) is refused by `_refuse_blocking_uploads` as well."""

    SYNCING = {
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.nonzero.default,
        torch.ops.aten.masked_select.default,
        torch.ops.aten.equal.default,
        torch.ops.aten.is_nonzero.default,
        torch.ops.aten._unique2.default,
        torch.ops.aten.unique_consecutive.default,
    }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SYNCING:
            raise AssertionError(f"{func} makes the host wait for the device")
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            target = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device", source.device)
            blocking = not kwargs.get("non_blocking", len(args) > 2 and args[2])
            if torch.device(target) != source.device and blocking:
                raise AssertionError(f"{func} copies {source.device} -> {target} and blocks")
        return func(*args, **kwargs)


@pytest.fixture
def _refuse_blocking_uploads(monkeypatch):
    original = torch.tensor

    def tensor(*args, **kwargs):
        if kwargs.get("device") is not None:
            raise AssertionError("torch.tensor(..., device=...) is a blocking upload on an accelerator")
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)


def _mixed_steps(ctl, weight, device):
    """Greedy, sampled and dense rows, with stop-id sets that come and go, fidelity checks on."""
    torch.manual_seed(3)
    codes = np.array([0, DenseReason.LOGPROBS, 0, 0], np.uint8)
    sampled = np.array([False, False, True, False])
    dense = _dense(weight.to(device))
    for stop_ids in ((), (7,), (7, 300), (7,), ()):
        hidden = torch.randn(4, HIDDEN, device=device)
        ctl.compute_logits(hidden, StepRows(codes, sampled, stop_ids=stop_ids), dense, lambda x: x * 0.5)


def test_a_step_never_makes_the_host_wait(weight, monkeypatch, _refuse_blocking_uploads):
    monkeypatch.setenv("MY_PKG_FLASHHEAD_FIDELITY_EVERY", "2")
    # As an accelerator's head: without the copy of its rows in cluster order, which only a CPU head keeps (and
    # checks against the weight, one row read back per step: on CPU there is no device to wait for).
    monkeypatch.setenv("MY_PKG_FLASHHEAD_CLUSTER_ROWS", "0")
    ctl = _pinned_controller(weight, [2, 5], n_probes=2)  # built and warmed up: the sampled tables exist
    with _NoHostWait():
        _mixed_steps(ctl, weight, weight.device)
    assert ctl.counters.rows_flashhead == 15 and ctl.counters.rows_dense["logprobs"] == 5
    assert ctl.status().counters.fidelity_rows > 0  # the checks ran, read back only by `status`


def test_the_host_wait_check_catches_a_blocking_upload(weight, _refuse_blocking_uploads):
    """The check fails on the upload the step path used to make (`torch.tensor(ids, device=...)`)."""
    with pytest.raises(AssertionError, match="blocking upload"):
        torch.tensor([1, 2], device=weight.device)
    with _NoHostWait(), pytest.raises(AssertionError, match="host wait"):
        bool(torch.ones(1).sum() > 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_step_on_cuda_never_synchronises(weight, monkeypatch):
    monkeypatch.setenv("MY_PKG_FLASHHEAD_FIDELITY_EVERY", "2")
    cuda_weight = weight.cuda()
    ctl = _pinned_controller(cuda_weight, [2, 5], n_probes=2)
    _mixed_steps(ctl, cuda_weight, cuda_weight.device)  # first uploads of each stop-id set, kernels compiled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _mixed_steps(ctl, cuda_weight, cuda_weight.device)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_start_up_timing_waits_for_the_device_and_decides_both_ways(weight, monkeypatch):
    """A real GPU: a dense product that queues tens of ms of device work returns at once to the host; timed with
    the device's clock it loses to FlashHead, which serves. One GEMM of a 512-token head beats FlashHead's several
    launches: that head stands down."""
    monkeypatch.delenv("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", raising=False)
    cuda_weight = weight.cuda()

    def slow_dense(hidden):
        torch.cuda._sleep(50_000_000)  # clock cycles: 25 ms at 2 GHz
        return hidden @ cuda_weight.T

    served = _unbuilt_controller(cuda_weight)
    served.prepare(cuda_weight, dense=slow_dense)
    assert served.head is not None and served.status().reason_code is None
    assert served.step_costs is not None and served.step_costs.dense_s[0] > 0.01
    stood_down = _unbuilt_controller(cuda_weight)
    stood_down.prepare(cuda_weight, dense=lambda hidden: hidden @ cuda_weight.T)
    assert stood_down.head is None and stood_down.status().reason_code == "slower_than_dense"
    assert "on cuda:0" in stood_down.status().reason


def test_pinned_ids_are_cached_per_stop_id_set_with_their_weight_rows(weight):
    ctl = _pinned_controller(weight, [2, 5])
    pins = ctl._pins
    uploads = pins.uploads
    hidden = torch.randn(1, HIDDEN)
    for _ in range(3):  # mixed traffic alternating two sets uploads each once
        for stop_ids in ((7,), (9, 11)):
            logits = ctl.compute_logits(
                hidden,
                StepRows(np.zeros(1, np.uint8), np.zeros(1, bool), stop_ids=stop_ids),
                _dense(weight),
                lambda x: x,
            )
            for token in (2, 5, *stop_ids):
                torch.testing.assert_close(logits[0, token], (hidden @ weight[:VOCAB].T)[0, token])
    assert pins.uploads - uploads == 2
    ids, rows = pins.get((9, 11), weight)
    assert ids.tolist() == [2, 5, 9, 11] and torch.equal(rows, weight[[2, 5, 9, 11]])
    for extra in range(20):  # a bounded cache
        pins.get((100 + extra,), weight)
    assert len(pins._cache) == pins.capacity


def test_the_assets_fitted_tail_estimate_is_served_and_a_bad_one_leaves_the_head_dense(weight, tmp_path):
    from safetensors.torch import save_file

    from my_pkg.flashhead.assets import CACHE_DIR_NAME, TAIL_FILE_NAME, save_clustering_cache, save_tail_factors
    from my_pkg.flashhead.tail_estimate import fit_tail_factors

    assignments = torch.arange(VOCAB) % CLUSTERS
    centroids = torch.stack([weight[:VOCAB][assignments == c].mean(0) for c in range(CLUSTERS)])
    save_clustering_cache(tmp_path, centroids, assignments)
    config = {"flash_head_cache_dir": CACHE_DIR_NAME, "n_probes": 4, "hidden_size": HIDDEN, "vocab_size": VOCAB}
    states = torch.randn(200, HIDDEN) * torch.linspace(0.1, 3.0, HIDDEN)
    save_tail_factors(tmp_path, fit_tail_factors(weight, VOCAB, 4, states))
    ctl = FlashHeadController.from_model_dir(str(tmp_path), config, vocab_size=VOCAB)
    ctl.bind(weight)
    assert ctl.available and ctl.head.tail_fitted

    save_file(
        {"left": torch.zeros(HIDDEN + 1, 4), "right": torch.zeros(HIDDEN + 1, 4)},
        str(tmp_path / CACHE_DIR_NAME / TAIL_FILE_NAME),
    )
    bad = FlashHeadController.from_model_dir(str(tmp_path), config, vocab_size=VOCAB)
    bad.bind(weight)
    assert not bad.available and bad.head is None
    assert bad.status().reason_code == "assets_invalid" and "tail_estimate" in bad.status().reason


def test_the_status_says_which_estimate_sampled_rows_get(weight, tmp_path):
    from my_pkg.flashhead.tail_estimate import fit_tail_factors

    assignments = torch.arange(VOCAB) % CLUSTERS
    centroids = torch.stack([weight[:VOCAB][assignments == c].mean(0) for c in range(CLUSTERS)])
    factors = fit_tail_factors(weight, VOCAB, 4, torch.randn(100, HIDDEN))
    fitted = FlashHeadController(
        centroids=centroids, assignments=assignments, config={"n_probes": 4}, vocab_size=VOCAB, tail_factors=factors
    )
    assert fitted.status().sampled_estimate is None  # no head yet
    fitted.bind(weight)
    assert fitted.status().sampled_estimate == "fitted"
    fitted.head.sampled_rank = 8  # above the fitted rank (MY_PKG_FLASHHEAD_SAMPLED_RANK=8): the weight-only fit
    assert fitted.status().sampled_estimate == "weight_only"
    fitted.head.sampled_rank = 4
    fitted.settings.probe_sampling = False  # MY_PKG_FLASHHEAD_PROBE_SAMPLING=0
    assert fitted.status().sampled_estimate == "off"
    plain = FlashHeadController(centroids=centroids, assignments=assignments, config={"n_probes": 4}, vocab_size=VOCAB)
    plain.bind(weight)
    assert plain.status().sampled_estimate == "weight_only"


def test_the_served_rank_keeps_a_fitted_estimates_sampled_row_within_the_budget(weight):
    """The controller hands the head the rank `default_sampled_rank` gives its shard, and reports it before the
    head is built too: 3 of the fitted factors' 4 at this narrow head, the weight-only estimate's 4."""
    from my_pkg.flashhead.spec import default_sampled_rank
    from my_pkg.flashhead.tail_estimate import fit_tail_factors

    assignments = torch.arange(VOCAB) % CLUSTERS
    centroids = torch.stack([weight[:VOCAB][assignments == c].mean(0) for c in range(CLUSTERS)])
    factors = fit_tail_factors(weight, VOCAB, 4, torch.randn(100, HIDDEN))
    for tail, rank in ((factors, 3), (None, 4)):
        ctl = FlashHeadController(
            centroids=centroids, assignments=assignments, config={"n_probes": 4}, vocab_size=VOCAB, tail_factors=tail
        )
        assert ctl.status().sampled_rank == rank == default_sampled_rank(VOCAB, HIDDEN, fitted_rank=4 if tail else 0)
        ctl.bind(weight)
        assert ctl.head.sampled_rank == ctl.status().sampled_rank == rank


def _unbuilt_controller(weight: torch.Tensor, config: dict | None = None) -> FlashHeadController:
    assignments = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0)) % CLUSTERS
    centroids = torch.stack([weight[:VOCAB][assignments == c].float().mean(0) for c in range(CLUSTERS)])
    return FlashHeadController(
        centroids=centroids, assignments=assignments, config=config or {"n_probes": 4}, vocab_size=VOCAB
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepare_times_the_head_beside_the_dense_product_when_no_threshold_is_set(weight, monkeypatch, dtype):
    monkeypatch.delenv("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", raising=False)
    weight = weight.to(dtype)
    ctl = _unbuilt_controller(weight)
    dense_rows: list[int] = []

    def dense(hidden):
        dense_rows.append(hidden.shape[0])
        return hidden @ weight.T

    ctl.prepare(weight, dense=dense)
    costs = ctl.status().step_costs
    assert ctl.head is not None and costs is not None
    assert costs.batches[0] == 1 and costs.batches == sorted(costs.batches)
    assert set(dense_rows) == set(costs.batches)  # the dense side is the product it was given
    for side in (costs.dense_ms, costs.greedy_ms, costs.sampled_ms):
        assert len(side) == len(costs.batches) and all(ms > 0 for ms in side)
    assert costs.mixed_ms is not None and costs.mixed_ms[0] is None  # no mixed step of one row
    assert len(costs.mixed_ms) == len(costs.batches) and all(ms > 0 for ms in costs.mixed_ms[1:])
    assert ctl.settings.dense_batch_threshold is None  # the measurement decides per step, not a threshold


def test_a_new_probe_count_answers_at_once_and_served_steps_time_it(weight, monkeypatch):
    """An update never times the head inside the RPC (the engine would wait for it): the start-up timing stays,
    FlashHead's side of it is forgotten, and the next served steps time the new probe count as they serve."""
    monkeypatch.delenv("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", raising=False)
    ctl = _unbuilt_controller(weight)
    calls = []

    def dense(hidden):
        calls.append(hidden.shape[0])
        return hidden @ weight.T

    ctl.prepare(weight, dense=dense)
    first, timed = ctl.step_costs, len(calls)
    assert first is not None and timed > 0 and ctl.ways.timed
    ctl.ways = type(ctl.ways)(replace(first, greedy_s=tuple(100.0 for _ in first.batches)))  # masked way cheaper
    hidden = torch.randn(4, HIDDEN)
    ctl.compute_logits(hidden, _rows([0] * 4), dense, lambda x: x)
    assert ctl.counters.rows_flashhead_masked == 4
    ctl.apply(FlashHeadUpdate(n_probes=CLUSTERS))
    assert ctl.step_costs is first and ctl.head.n_probes == CLUSTERS  # nothing timed again
    calls.clear()
    ctl.compute_logits(hidden, _rows([0] * 4), dense, lambda x: x)
    assert calls == [] and ctl.counters.rows_flashhead_masked == 4  # FlashHead's kernels, timed as they serve
    (served,) = [way for way in ctl.status().step_costs.served if way.rows == "3-4"]
    assert served.flashhead_ms is not None and served.flashhead_ms < 100.0


@pytest.mark.parametrize("env_value", ["never", "9"])
def test_an_operator_threshold_skips_the_timing(weight, monkeypatch, env_value):
    monkeypatch.setenv("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", env_value)
    ctl = _unbuilt_controller(weight)
    ctl.prepare(weight, dense=_dense(weight))
    assert ctl.head is not None and ctl.step_costs is None and ctl.status().step_costs is None
    assert ctl.status().dense_batch_threshold == (None if env_value == "never" else 9)


def test_a_vocabulary_shard_is_timed_alone_with_its_share_of_stage_1(weight, monkeypatch):
    """A tensor-parallel rank times its own part with no collective: its share of the centroids, its best
    clusters as probes and its candidates, beside its shard of the dense product."""
    monkeypatch.delenv("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", raising=False)
    shard = _unbuilt_controller(weight)
    dense_rows = []

    def dense_shard(hidden):
        dense_rows.append(hidden.shape[0])
        return hidden @ weight[: VOCAB // 2].T

    from my_pkg.flashhead.probes import ShardStage1

    shard_keys, real_keys = [], ShardStage1.keys

    def keys(self, hidden, width):
        shard_keys.append(hidden.shape[0])
        return real_keys(self, hidden, width)

    monkeypatch.setattr(ShardStage1, "keys", keys)
    shard.prepare(weight[: VOCAB // 2], vocab_range=(0, VOCAB // 2), shard=(0, 2), dense=dense_shard)
    costs = shard.status().step_costs
    assert shard.head is not None and costs is not None
    assert set(dense_rows) == set(costs.batches) and set(costs.batches) <= set(shard_keys)
    assert costs.masked_greedy_ms is not None and len(costs.masked_greedy_ms) == len(costs.batches)


def _on_an_accelerator(monkeypatch, flashhead_delay_s: float, dense_delay_s: float):
    """Heads timed as an accelerator's (`build.on_host` False), with each side's step `delay_s` slower."""
    import time

    from my_pkg.engine.flashhead import build

    monkeypatch.setattr(build, "on_host", lambda head: False)
    real_step = build.head_step

    def delayed_step(*args):
        step = real_step(*args)
        return lambda hidden, sampled: (time.sleep(flashhead_delay_s), step(hidden, sampled))[1]

    monkeypatch.setattr(build, "head_step", delayed_step)
    return lambda weight: lambda hidden: (time.sleep(dense_delay_s), hidden @ weight.T)[1]


def test_an_accelerators_head_slower_than_the_dense_head_stands_down(weight, monkeypatch, caplog):
    """On a GPU FlashHead's kernels can cost more than vLLM's dense product (several launches against one GEMM): the
    head measured so at one row is dropped, and the model serves vLLM's dense head, with the figures in the status."""
    monkeypatch.delenv("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", raising=False)
    dense = _on_an_accelerator(monkeypatch, flashhead_delay_s=0.004, dense_delay_s=0.0)
    ctl = _unbuilt_controller(weight)
    ctl.prepare(weight, dense=dense(weight))
    state = ctl.status()
    assert ctl.head is None and not ctl.available and state.active is False
    assert state.reason_code == "slower_than_dense"
    assert "measured slower than the dense head at 1 row(s): a greedy step" in state.reason and "on cpu" in state.reason
    assert state.step_costs is not None and state.step_costs.greedy_ms[0] > state.step_costs.dense_ms[0]
    assert state.step_costs.masked_greedy_ms is None  # the masked way is timed on the host only
    assert "dense head in use" in caplog.text


def test_an_accelerators_head_faster_than_the_dense_head_serves_every_step(weight, monkeypatch):
    monkeypatch.delenv("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", raising=False)
    dense = _on_an_accelerator(monkeypatch, flashhead_delay_s=0.0, dense_delay_s=0.004)
    ctl = _unbuilt_controller(weight)
    ctl.prepare(weight, dense=dense(weight))
    assert ctl.head is not None and ctl.available and ctl.status().reason_code is None
    assert ctl.step_costs is not None and not ctl.ways.timed  # no per-step choice: the host clock times no step here
    ctl.compute_logits(torch.randn(4, HIDDEN), _rows([0] * 4), _dense(weight), lambda x: x)
    assert ctl.counters.rows_flashhead == 4 and ctl.counters.rows_flashhead_masked == 0


def test_an_operator_threshold_keeps_an_accelerators_head_serving_untimed(weight, monkeypatch):
    monkeypatch.setenv("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", "never")
    dense = _on_an_accelerator(monkeypatch, flashhead_delay_s=0.004, dense_delay_s=0.0)
    ctl = _unbuilt_controller(weight)
    ctl.prepare(weight, dense=dense(weight))
    assert ctl.head is not None and ctl.step_costs is None and ctl.status().reason_code is None


def test_a_failing_dense_product_is_not_timed(weight, monkeypatch, caplog):
    monkeypatch.delenv("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", raising=False)

    def broken(hidden):
        raise RuntimeError("no product")

    ctl = _unbuilt_controller(weight)
    ctl.prepare(weight, dense=broken)
    assert ctl.head is not None and ctl.step_costs is None  # FlashHead serves every step, as before
    assert "could not time its steps" in caplog.text


def test_the_status_reports_from_which_batch_each_kind_of_step_takes_the_masked_way(controller):
    # The masked way costs the dense product plus 1 (greedy) or 3 (sampled) over it; FlashHead's kernels cost more
    # than 1.1 times that from 8 greedy rows and from 2 sampled rows.
    controller.step_costs = StepCosts(
        batches=(1, 2, 4, 8),
        dense_s=(4.0, 4.0, 4.0, 5.0),
        greedy_s=(1.0, 2.0, 3.0, 9.0),
        sampled_s=(2.0, 8.0, 10.0, 20.0),
        masked_greedy_s=(5.0, 5.0, 5.0, 6.0),
        masked_sampled_s=(7.0, 7.0, 7.0, 8.0),
    )
    report = controller.status().step_costs
    assert (report.masked_from_greedy, report.masked_from_sampled) == (8, 2)
    assert report.masked_greedy_ms == [5000.0, 5000.0, 5000.0, 6000.0]


def _masked_from_two_rows() -> StepCosts:
    """FlashHead's kernels pay at one row; from two rows the dense product masked to their answer is cheaper."""
    return StepCosts(
        batches=(1, 2, 4, 8),
        dense_s=(4.0, 4.0, 4.0, 8.0),
        greedy_s=(1.0, 6.0, 9.0, 20.0),
        sampled_s=(2.0, 8.0, 10.0, 20.0),
        masked_greedy_s=(4.5, 4.5, 4.5, 8.5),
        masked_sampled_s=(5.0, 5.0, 5.0, 9.0),
    )


@pytest.mark.parametrize("probe_sampling", [True, False])
def test_the_way_that_serves_a_step_never_changes_a_rows_answer(controller, weight, probe_sampling):
    """Alone, in a larger step the masked way serves, beside a logprobs row: every FlashHead row gets the same
    tokens (the same ones out of reach, the same argmax, the same estimates), and the logprobs row vLLM's logits."""
    from my_pkg.engine.flashhead.timing import StepWays

    controller.settings.probe_sampling = probe_sampling
    dense = _dense(weight)
    hidden = torch.randn(4, HIDDEN)
    sampled = [False, True, False, True]
    alone = torch.cat(
        [controller.compute_logits(hidden[i : i + 1], _rows([0], [sampled[i]]), dense, lambda x: x) for i in range(4)]
    )
    controller.step_costs = _masked_from_two_rows()
    controller.ways = StepWays(controller.step_costs)
    together = controller.compute_logits(hidden, _rows([0] * 4, sampled), dense, lambda x: x)
    assert controller.counters.rows_flashhead_masked == 4 and controller.counters.rows_flashhead == 8
    beside = controller.compute_logits(hidden, _rows([0, 0, DenseReason.LOGPROBS, 0], sampled), dense, lambda x: x)
    torch.testing.assert_close(beside[2], dense(hidden[2:3])[0])  # the logprobs row: exact, moved nothing
    for logits, rows in ((together, [0, 1, 2, 3]), (beside, [0, 1, 3])):
        assert torch.equal(torch.isinf(logits[rows]), torch.isinf(alone[rows]))
        assert torch.equal(logits[rows].argmax(-1), alone[rows].argmax(-1))
        torch.testing.assert_close(logits[rows], alone[rows], atol=1e-5, rtol=1e-5)
    assert controller.counters.rows_dense == {"logprobs": 1}
    status = controller.status()
    # `beside` is the second step of its bucket: the other way (the kernels), so both ways met `alone` here.
    assert status.counters.rows_flashhead_masked == status.recent.rows_flashhead_masked == 4
    assert status.recent.flashhead_share == pytest.approx(11 / 12, abs=1e-4)
