"""FlashHead as the drafter's head: vLLM's real `DraftModelProposer._greedy_sample` (hooked, `method:
draft_model`) over a draft model with vLLM's `ParallelLMHead` and our logits processor, and vLLM's real
`EagleProposer` over an EAGLE head that vLLM gave the target's LM head; the draft part of the status, its
counters, its refusals and its fallback."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from my_pkg.contract import FlashHeadState
from my_pkg.engine.flashhead import FlashHeadController
from my_pkg.engine.flashhead.draft import configure_draft, default_draft_n_probes, draft_rows, refusal
from my_pkg.engine.flashhead.spec import spec_state

VOCAB, HIDDEN, CAP = 256, 16, 16
CLUSTERS = VOCAB // CAP
DRAFT_MODEL = SimpleNamespace(method="draft_model", num_speculative_tokens=3, draft_sample_method="greedy")
EAGLE = SimpleNamespace(method="eagle", num_speculative_tokens=2, draft_sample_method="greedy")


def _assets(weight: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    assignments = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed)) % CLUSTERS
    centroids = torch.stack([weight[assignments == c].mean(0) for c in range(CLUSTERS)])
    return centroids, assignments


def _model(controller: FlashHeadController | None, seed: int) -> torch.nn.Module:
    """A vLLM-built model as the hooks see it: a `ParallelLMHead`, our logits processor holding
    `controller`, and `compute_logits` as vLLM's Llama has it."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from my_pkg.engine.patches import logits_processor

    class Model(torch.nn.Module):
        def compute_logits(self, hidden_states):
            return self.logits_processor(self.lm_head, hidden_states)

    model = Model()
    model.lm_head = ParallelLMHead(VOCAB, HIDDEN, disable_tp=True)
    model.lm_head.weight.requires_grad_(False)
    model.lm_head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed)))
    model.lm_head.quant_method.process_weights_after_loading(model.lm_head)  # as vLLM's loader does
    model.logits_processor = logits_processor.subclass()(VOCAB)
    model.logits_processor._my_pkg_flashhead = controller
    return model


@pytest.fixture
def setup(flashhead_hooks):
    """A FlashHead target (its status knows a draft model is configured) and vLLM's real draft-model
    proposer over a FlashHead draft model, not yet loaded."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    with set_current_vllm_config(VllmConfig()):
        target_weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1))
        centroids, assignments = _assets(target_weight, 1)
        target = FlashHeadController(
            centroids=centroids,
            assignments=assignments,
            config={"n_probes": 2},
            vocab_size=VOCAB,
        )
        target.spec = spec_state(DRAFT_MODEL, v2=False, hook_error=None, draft_hook_error=None)
        target_model = _model(target, 1)
        target.prepare(target_model.lm_head.weight)
        draft_model = _model(None, 2)
        centroids, assignments = _assets(draft_model.lm_head.weight.detach(), 2)
        draft = configure_draft(
            FlashHeadController(centroids=centroids, assignments=assignments, config={}, vocab_size=VOCAB),
            {"n_probes": 3},
        )
        draft_model.logits_processor._my_pkg_flashhead = draft
        proposer = object.__new__(DraftModelProposer)  # what `load_model` leaves on it, nothing else
        proposer.__dict__.update(
            method="draft_model",
            use_heterogeneous_vocab=False,
            use_local_argmax_reduction=False,
            model=draft_model,
            draft_model_config=SimpleNamespace(
                hf_config=SimpleNamespace(flash_head_cache_dir="flash_head_assets"), enable_sleep_mode=False
            ),
        )
        yield SimpleNamespace(target=target, target_model=target_model, draft=draft, proposer=proposer)


def _dense_argmax(setup, hidden):
    return (hidden @ setup.proposer.model.lm_head.weight.detach().T).argmax(-1)


def test_the_draft_part_is_decided_when_the_drafter_loads_and_its_head_is_built_then(setup):
    from my_pkg.engine.patches import spec_proposer

    assert setup.target.status().spec.draft.reason_code == "draft_not_loaded"
    spec_proposer.link_drafter(setup.proposer, setup.target_model)
    assert setup.draft.head is not None  # before vLLM sizes the KV cache
    assert setup.target.draft is setup.draft
    state = FlashHeadState.model_validate(setup.target.status().model_dump())
    assert state.spec.draft.active and state.spec.draft.reason_code is None
    assert state.spec.draft_n_probes == 3 and state.n_probes == 2  # its own probe count
    assert state.spec.verify.active


def test_a_drafter_loaded_again_is_linked_again(setup):
    from my_pkg.engine.patches import spec_proposer

    spec_proposer.link_drafter(setup.proposer, setup.target_model)
    spec_proposer.link_drafter(setup.proposer, setup.target_model)
    assert setup.target.draft is setup.draft and setup.proposer.__dict__[spec_proposer.DRAFT_ATTR] is setup.draft
    assert setup.target.status().spec.draft.active


def test_greedy_drafts_go_through_the_drafters_flashhead_head_and_are_counted_apart(setup):
    from my_pkg.engine.patches import spec_proposer

    proposer, draft = setup.proposer, setup.draft
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(3))
    assert torch.equal(proposer._greedy_sample(hidden), _dense_argmax(setup, hidden))  # not linked yet: vLLM's own
    spec_proposer.link_drafter(proposer, setup.target_model)

    drafts = proposer._greedy_sample(hidden)  # vLLM's own method, hooked
    expected = draft.head.step_logits(hidden).argmax(-1)
    assert torch.equal(drafts, expected)
    counters = setup.target.status().counters
    assert counters.rows_flashhead_draft == 5 and counters.rows_flashhead == 0 and counters.steps == 0
    assert not draft.armed  # the arming is consumed by the one call
    # Every cluster probed: the dense drafter's argmax.
    draft.settings.n_probes = draft.head.n_probes = CLUSTERS
    assert torch.equal(proposer._greedy_sample(hidden), _dense_argmax(setup, hidden))


def test_probabilistic_drafts_are_drawn_from_the_drafters_flashhead_probabilities(setup):
    """`draft_sample_method: probabilistic`: a step with sampled requests draws its drafts from the drafter's
    probabilities and hands them to the rejection sampler. Linked, those are FlashHead's sampled rows' (every
    token a probability: exact candidates, estimated tail), counted as draft rows; greedy steps still go
    through `_greedy_sample`."""
    from my_pkg.engine.patches import spec_proposer

    proposer, draft = setup.proposer, setup.draft
    proposer.__dict__.update(_enable_probabilistic_draft_probs=True, use_fp64_gumbel=False)
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(4))
    sampled = SimpleNamespace(all_greedy=False, all_random=True, temperature=torch.full((5,), 0.7))
    dense_probs = torch.softmax(hidden @ proposer.model.lm_head.weight.detach().T / 0.7, dim=-1)
    _, probs = proposer._sample_draft_tokens(hidden, sampled)  # not linked yet: vLLM's own (dense) law
    torch.testing.assert_close(probs, dense_probs)
    spec_proposer.link_drafter(proposer, setup.target_model)

    drafts, probs = proposer._sample_draft_tokens(hidden, sampled)  # vLLM's own method, hooked
    flashhead = draft.head.step_logits(hidden, sampled=np.ones(5, bool))
    torch.testing.assert_close(probs, torch.softmax(flashhead / 0.7, dim=-1))
    assert bool((probs > 0).all())  # the estimated tail: every token can be drawn, and is accounted for
    assert not torch.allclose(probs, dense_probs)
    assert bool((probs.gather(1, drafts.view(-1, 1)) > 0).all())
    counters = setup.target.status().counters
    assert counters.rows_flashhead_draft == 5 and counters.rows_flashhead == 0
    assert not draft.armed
    # A step of greedy requests: drafts by `_greedy_sample` (FlashHead's greedy rows), no probabilities.
    greedy = SimpleNamespace(all_greedy=True, all_random=False, temperature=None)
    drafts, probs = proposer._sample_draft_tokens(hidden, greedy)
    assert probs is None and torch.equal(drafts, draft.head.step_logits(hidden).argmax(-1))
    assert setup.target.status().counters.rows_flashhead_draft == 10


def test_the_drafter_follows_the_targets_switch(setup):
    from my_pkg.contract import FlashHeadUpdate
    from my_pkg.engine.patches import spec_proposer

    spec_proposer.link_drafter(setup.proposer, setup.target_model)
    setup.target.apply(FlashHeadUpdate(enabled=False))
    hidden = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(4))
    assert torch.equal(setup.proposer._greedy_sample(hidden), _dense_argmax(setup, hidden))
    state = setup.target.status()
    assert state.counters.rows_flashhead_draft == 0 and state.counters.rows_dense_draft == 4
    assert state.spec.draft.reason_code == "flashhead_inactive"
    setup.target.apply(FlashHeadUpdate(enabled=True))
    setup.proposer._greedy_sample(hidden)
    assert setup.target.status().counters.rows_flashhead_draft == 4


def test_draft_n_probes_is_put_with_the_other_settings_and_refused_without_a_flashhead_drafter(setup):
    from pydantic import ValidationError

    from my_pkg.contract import FlashHeadUpdate
    from my_pkg.engine.patches import spec_proposer

    target, draft = setup.target, setup.draft
    (refused,) = target.validate(FlashHeadUpdate(draft_n_probes=4))
    assert "drafter" in refused and "draft_not_loaded" in refused  # all-or-none: no worker applies it
    spec_proposer.link_drafter(setup.proposer, setup.target_model)
    assert target.validate(FlashHeadUpdate(draft_n_probes=CLUSTERS + 1)) == [
        f"draft_n_probes must be <= the draft model's number of clusters ({CLUSTERS})"
    ]
    assert target.validate(FlashHeadUpdate(draft_n_probes=CLUSTERS, n_probes=4)) == []
    target.apply(FlashHeadUpdate(draft_n_probes=CLUSTERS, n_probes=4))
    state = target.status()
    assert state.spec.draft_n_probes == CLUSTERS and draft.head.n_probes == CLUSTERS
    assert state.n_probes == 4 and target.head.n_probes == 4  # each head keeps its own count
    hidden = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(6))
    assert torch.equal(setup.proposer._greedy_sample(hidden), _dense_argmax(setup, hidden))  # every cluster
    with pytest.raises(ValidationError):
        FlashHeadUpdate.model_validate({"draft_n_probes": None})
    with pytest.raises(ValidationError):
        FlashHeadUpdate.model_validate({"draft_n_probes": 0})


def test_a_failing_draft_head_serves_dense_and_is_counted(setup, monkeypatch):
    from my_pkg.engine.patches import spec_proposer

    spec_proposer.link_drafter(setup.proposer, setup.target_model)

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(setup.draft.head, "step_logits", broken)
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(5))
    assert torch.equal(setup.proposer._greedy_sample(hidden), _dense_argmax(setup, hidden))
    counters = setup.target.status().counters
    assert counters.fallbacks == 1 and counters.rows_dense_draft == 3 and counters.rows_flashhead_draft == 0


def test_a_draft_head_that_failed_to_build_is_refused(setup, monkeypatch):
    from my_pkg.engine.patches import spec_proposer

    def build_fails(proposer, draft):
        draft.make_unavailable("build_failed", "FlashHead could not be built: no room on this device")

    monkeypatch.setattr(spec_proposer, "_build", build_fails)
    spec_proposer.link_drafter(setup.proposer, setup.target_model)
    assert setup.proposer.__dict__.get(spec_proposer.DRAFT_ATTR) is None
    assert setup.target.status().spec.draft.reason_code == "draft_head_unavailable"


@pytest.mark.parametrize("this_rank_fails", [True, False])
def test_under_tensor_parallelism_a_drafter_one_rank_cannot_serve_is_unlinked_on_every_rank(
    setup, monkeypatch, this_rank_fails
):
    """The ranks agree once, when the drafter loads: one whose drafter head failed (this rank or another) makes
    every rank keep its drafter dense, so that no rank's draft step enters a stage-1 exchange another skips."""
    from my_pkg.engine.patches import spec_proposer

    if this_rank_fails:
        monkeypatch.setattr(
            spec_proposer, "_build", lambda proposer, draft: draft.make_unavailable("build_failed", "no room")
        )
    offered = []
    monkeypatch.setattr(spec_proposer, "tensor_parallel", lambda: True)
    monkeypatch.setattr(spec_proposer, "every_rank", lambda flag, device: offered.append(flag) or False)
    target_config = SimpleNamespace(hf_config=SimpleNamespace(flash_head_cache_dir="flash_head_assets"))
    monkeypatch.setattr(setup.proposer, "vllm_config", SimpleNamespace(model_config=target_config), raising=False)
    spec_proposer.link_drafter(setup.proposer, setup.target_model)
    spec_proposer.agree_drafter(setup.proposer, setup.target_model)
    assert offered == [not this_rank_fails]  # this rank's own answer went into the one collective
    assert setup.proposer.__dict__.get(spec_proposer.DRAFT_ATTR) is None and setup.target.draft is None
    assert setup.target.status().spec.draft.reason_code == "draft_head_unavailable"
    assert setup.draft.exchange_width(4) is None


def test_a_draft_model_without_assets_stays_dense_with_its_reason(setup):
    from my_pkg.engine.patches import spec_proposer

    setup.proposer.model.logits_processor._my_pkg_flashhead = None
    setup.proposer.draft_model_config.hf_config = SimpleNamespace()
    spec_proposer.link_drafter(setup.proposer, setup.target_model)
    state = setup.target.status()
    assert not state.spec.draft.active and state.spec.draft.reason_code == "draft_no_assets"
    assert state.spec.draft_n_probes is None and setup.target.draft is None
    hidden = torch.randn(2, HIDDEN)
    assert torch.equal(setup.proposer._greedy_sample(hidden), _dense_argmax(setup, hidden))


def test_a_drafter_that_cannot_be_linked_stays_dense_with_its_reason(setup, monkeypatch):
    """vLLM's own `load_model` (hooked) loads the drafter; linking it fails: vLLM's drafter as it is."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    from my_pkg.engine.patches import spec_proposer

    def broken(proposer, target_model):
        raise RuntimeError("moved")

    monkeypatch.setattr(spec_proposer, "link_drafter", broken)
    loaded = []
    hook = SpecDecodeBaseProposer.load_model  # our wrapper around vLLM's own
    (cell,) = [c for c in hook.__closure__ if c.cell_contents is hook.__wrapped__]
    # vLLM's load itself needs a whole engine: stand in for it by its effect, inside the real wrapper.
    monkeypatch.setattr(cell, "cell_contents", lambda self, target_model: loaded.append(target_model))
    hook(setup.proposer, setup.target_model)
    assert loaded == [setup.target_model]
    state = setup.target.status()
    assert state.spec.draft.reason_code == "draft_hook_failed" and "moved" in state.spec.draft.reason
    hidden = torch.randn(2, HIDDEN)
    assert torch.equal(setup.proposer._greedy_sample(hidden), _dense_argmax(setup, hidden))


def test_a_part_the_configuration_decided_is_left_as_it_is(setup):
    from my_pkg.engine.patches import spec_proposer

    setup.target.spec = spec_state(DRAFT_MODEL, v2=True, hook_error=None)
    spec_proposer.link_drafter(setup.proposer, setup.target_model)
    assert setup.target.spec.draft.reason_code == "model_runner_v2" and setup.target.draft is None
    assert spec_proposer.DRAFT_ATTR not in setup.proposer.__dict__


def _proposer(shares=False, **change):
    fields = dict(
        shares=shares,
        method="draft_model",
        use_heterogeneous_vocab=False,
        use_local_argmax_reduction=False,
        draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(flash_head_cache_dir="a")),
    )
    return SimpleNamespace(**{**fields, **change})


def _controller(vocab=VOCAB, available=True):
    weight = torch.randn(vocab, HIDDEN)
    assignments = torch.arange(vocab) % CLUSTERS
    centroids = torch.stack([weight[assignments == c].mean(0) for c in range(CLUSTERS)])
    return FlashHeadController(
        centroids=centroids if available else None,
        assignments=assignments if available else None,
        config={},
        vocab_size=vocab,
    )


@pytest.mark.parametrize(
    ("proposer", "draft", "code"),
    [
        (_proposer(), "ok", None),
        (_proposer(method="mtp"), "ok", "draft_head_not_supported"),
        (_proposer(method="medusa"), "ok", "draft_head_not_supported"),
        (_proposer(method="eagle", shares=True), "ok", None),
        (_proposer(method="eagle3", shares=True), "ok", None),
        (_proposer(method="eagle"), "ok", "draft_no_assets"),  # its own LM head: the assets are the target's
        (_proposer(method="eagle", shares=True), None, "draft_head_unavailable"),
        (_proposer(method="eagle3", shares=True), "other vocabulary", "draft_vocab_mismatch"),
        (_proposer(use_heterogeneous_vocab=True), "ok", "draft_vocab_mismatch"),
        (_proposer(draft_model_config=SimpleNamespace(hf_config=SimpleNamespace())), None, "draft_no_assets"),
        (_proposer(), None, "draft_head_unavailable"),
        (_proposer(), "other vocabulary", "draft_vocab_mismatch"),
        (_proposer(use_local_argmax_reduction=True), "ok", "draft_head_unavailable"),
        (_proposer(), "no assets", "draft_head_unavailable"),
    ],
)
def test_each_refusal_has_its_code(proposer, draft, code):
    drafts = {
        "ok": lambda: _controller(),
        "other vocabulary": lambda: _controller(VOCAB + 16),
        "no assets": lambda: _controller(available=False),
        None: lambda: None,
    }
    refused = refusal(proposer, _controller(), drafts[draft](), shares_target_head=proposer.shares)
    assert (refused[0] if refused else None) == code


def test_the_drafters_probe_count_is_its_checkpoints_own():
    assert default_draft_n_probes({"n_probes": 12}, 64) == 12
    assert default_draft_n_probes({"n_probes": 500}, 64) == 64
    assert default_draft_n_probes({}, 512) == 16  # the builder's default: 1/32 of the clusters, at least 8
    assert default_draft_n_probes({"n_probes": True}, 64) == 8
    rows = draft_rows(3)
    assert rows.num_rows == 3 and not rows.dense_codes.any() and not rows.sampled.any()
    assert rows.verify_rows is None and isinstance(rows.dense_codes, np.ndarray)


def test_the_drafters_probe_count_at_start_up_follows_its_environment_variable(monkeypatch, caplog):
    """`MY_PKG_FLASHHEAD_DRAFT_N_PROBES` before the checkpoint's `n_probes`, capped at the drafter's clusters; the
    target's variable does not reach the drafter; the drafter's controller starts at it."""
    monkeypatch.setenv("MY_PKG_FLASHHEAD_N_PROBES", "9")
    assert default_draft_n_probes({"n_probes": 12}, 64) == 12  # the target's variable: not the drafter's
    monkeypatch.setenv("MY_PKG_FLASHHEAD_DRAFT_N_PROBES", "5")
    assert default_draft_n_probes({"n_probes": 12}, 64) == 5
    assert default_draft_n_probes({}, 512) == 5
    assert configure_draft(_controller(), {"n_probes": 12}).settings.n_probes == 5
    monkeypatch.setenv("MY_PKG_FLASHHEAD_DRAFT_N_PROBES", "500")
    with caplog.at_level("WARNING"):
        assert default_draft_n_probes({"n_probes": 12}, 64) == 64
    assert "draft_n_probes=500 exceeds 64 clusters" in caplog.text
    monkeypatch.setenv("MY_PKG_FLASHHEAD_DRAFT_N_PROBES", "0")  # invalid: ignored with a warning
    assert default_draft_n_probes({"n_probes": 12}, 64) == 12


def _vllm_config(method, target_assets=True):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(
            method=method,
            target_model_config=SimpleNamespace(
                hf_config=SimpleNamespace(flash_head_cache_dir="a") if target_assets else SimpleNamespace()
            ),
        ),
        model_config=SimpleNamespace(model="/nonexistent", dtype=torch.float32, head_dtype=None, hf_config=None),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1),
        lora_config=None,
    )


def test_only_a_draft_model_beside_a_flashhead_target_gets_a_drafters_controller():
    from my_pkg.engine.setup import make_draft_controller as _make_draft_controller

    config = {"flash_head_cache_dir": "flash_head_assets", "n_probes": 5}
    for method in ("eagle", "eagle3", "mtp", "medusa"):  # an EAGLE head gets its controller when it loads (below)
        assert _make_draft_controller(_vllm_config(method), config, VOCAB) is None
    assert _make_draft_controller(_vllm_config("draft_model", target_assets=False), config, VOCAB) is None
    controller = _make_draft_controller(_vllm_config("draft_model"), config, VOCAB)
    assert isinstance(controller, FlashHeadController)
    assert controller.settings.n_probes == 5 and controller.settings.fidelity_every == 0 and controller.spec is None
    assert (
        controller.unavailable_code == "assets_invalid"
    )  # no such directory: refused at load (draft_head_unavailable)


# ---- EAGLE: a head that computes its logits with the target's LM head ------------------------------------


@pytest.fixture
def eagle(setup, monkeypatch):
    """vLLM's real EAGLE proposer over an EAGLE head as `load_model` leaves it: vLLM gave it the target's LM head
    module (`_maybe_share_lm_head`), its own logits processor has no controller (none is made while vLLM builds
    an EAGLE head). The controller the hook makes over the target's assets is built from the target's centroids
    here (the real maker reads them from the target's model directory: tested below)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.spec_decode.eagle import EagleProposer

    from my_pkg.engine.patches import spec_proposer

    setup.target.spec = spec_state(EAGLE, v2=False, hook_error=None, draft_hook_error=None)
    with set_current_vllm_config(VllmConfig()):
        drafter = _model(None, 3)
    drafter.lm_head = setup.target_model.lm_head
    made = []

    def make(vllm_config, org_vocab_size):
        made.append((vllm_config, org_vocab_size))
        centroids, assignments = _assets(setup.target_model.lm_head.weight.detach(), 1)  # the target's assets
        controller = FlashHeadController(
            centroids=centroids, assignments=assignments, config={}, vocab_size=org_vocab_size
        )
        return configure_draft(controller, {"n_probes": 3})

    monkeypatch.setattr(spec_proposer, "make_shared_draft_controller", make)
    proposer = object.__new__(EagleProposer)
    proposer.__dict__.update(
        method="eagle",
        use_heterogeneous_vocab=False,
        use_local_argmax_reduction=False,
        model=drafter,
        vllm_config="the engine's config",
        draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(), enable_sleep_mode=False),
    )
    yield SimpleNamespace(setup=setup, proposer=proposer, drafter=drafter, made=made)


def _target_argmax(eagle, hidden):
    return (hidden @ eagle.setup.target_model.lm_head.weight.detach().T).argmax(-1)


def test_an_eagle_head_drafts_through_flashhead_over_the_targets_lm_head(eagle):
    from my_pkg.engine.patches import spec_proposer

    target, proposer, lm_head = eagle.setup.target, eagle.proposer, eagle.setup.target_model.lm_head
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(7))
    assert torch.equal(proposer._greedy_sample(hidden), _target_argmax(eagle, hidden))  # not linked: vLLM's own
    assert target.status().spec.draft.reason_code == "draft_not_loaded"

    spec_proposer.link_drafter(proposer, eagle.setup.target_model)
    assert eagle.made == [("the engine's config", VOCAB)]  # made from the engine's config, at the head's vocabulary
    draft = eagle.drafter.logits_processor._my_pkg_flashhead
    assert draft is not None and target.draft is draft and draft is not target
    assert draft.head is not None and draft.head.weight is lm_head.weight  # over the shared weight, not a copy
    assert draft.head is not target.head and target.head.n_probes == 2
    state = FlashHeadState.model_validate(target.status().model_dump())
    assert state.spec.method == "eagle" and state.spec.draft.active and state.spec.draft_n_probes == 3

    drafts = proposer._greedy_sample(hidden)  # vLLM's own method, hooked
    assert torch.equal(drafts, draft.head.step_logits(hidden).argmax(-1))
    counters = target.status().counters
    assert counters.rows_flashhead_draft == 5 and counters.rows_flashhead == 0 and counters.rows_dense_draft == 0
    # Every cluster probed: the dense drafter's argmax, the target's head untouched.
    draft.settings.n_probes = draft.head.n_probes = CLUSTERS
    assert torch.equal(proposer._greedy_sample(hidden), _target_argmax(eagle, hidden))
    assert target.head.n_probes == 2

    # vLLM loads the drafter again: the controller already on its processor is linked again, none is made.
    spec_proposer.link_drafter(proposer, eagle.setup.target_model)
    assert len(eagle.made) == 1 and target.draft is draft and target.status().spec.draft.active


def test_an_eagle_head_with_its_own_lm_head_stays_dense(eagle):
    from vllm.config import VllmConfig, set_current_vllm_config

    from my_pkg.engine.patches import spec_proposer

    with set_current_vllm_config(VllmConfig()):
        eagle.drafter.lm_head = _model(None, 4).lm_head  # trained its own: FlashHead's assets do not fit it
    spec_proposer.link_drafter(eagle.proposer, eagle.setup.target_model)
    state = eagle.setup.target.status()
    assert state.spec.draft.reason_code == "draft_no_assets" and "own" in state.spec.draft.reason
    assert eagle.made == [] and eagle.drafter.logits_processor._my_pkg_flashhead is None
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(8))
    expected = (hidden @ eagle.drafter.lm_head.weight.detach().T).argmax(-1)
    assert torch.equal(eagle.proposer._greedy_sample(hidden), expected)
    assert eagle.setup.target.status().counters.rows_flashhead_draft == 0


def test_an_eagle_heads_controller_reads_the_targets_assets_at_its_own_probe_count(tmp_path):
    """The real maker: the target's model config (the drafter's is the EAGLE checkpoint's), its `n_probes` as the
    drafter's, no fidelity check; a target without assets gives none."""
    from my_pkg.engine.setup import make_shared_draft_controller

    def config(target_hf):
        target = SimpleNamespace(model=str(tmp_path / "missing"), revision=None, hf_config=target_hf)
        return SimpleNamespace(
            speculative_config=SimpleNamespace(method="eagle", target_model_config=target),
            model_config=SimpleNamespace(dtype=torch.float32, head_dtype=None),
            parallel_config=SimpleNamespace(pipeline_parallel_size=1),
            lora_config=None,
        )

    assets = SimpleNamespace(flash_head_cache_dir="flash_head_assets", n_probes=7)
    controller = make_shared_draft_controller(config(assets), VOCAB)
    assert isinstance(controller, FlashHeadController)
    assert controller.settings.n_probes == 7 and controller.settings.fidelity_every == 0 and controller.spec is None
    assert controller.unavailable_code == "assets_invalid"  # no such directory: refused at load
    assert make_shared_draft_controller(config(SimpleNamespace()), VOCAB) is None
