"""Data-aware stage 1 (``my_pkg.flashhead.calibration`` and ``my-pkg flashhead build --calibration``)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from my_pkg.cli import main
from my_pkg.flashhead import FlashHead
from my_pkg.flashhead.assets import (
    CACHE_DIR_NAME,
    CACHE_FILE_NAME,
    CALIBRATION_KEY,
    load_assets,
    load_tail_factors,
    read_config,
)
from my_pkg.flashhead.calibration import (
    agreement_curve,
    agreement_lower_bound,
    calibrate_stage1,
    choose_n_probes,
    cluster_targets,
    fit_stage1,
    probes_needed,
    scored_fraction,
)
from my_pkg.flashhead.clustering import balanced_kmeans, random_balanced_assignment
from my_pkg.flashhead.evaluate import synthetic_head, synthetic_hidden_states

VOCAB, HIDDEN = 1024, 32


def _states(weight: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """LM-like states: aimed at a head row, plus a shared offset direction (as trained LMs have)."""
    hidden = synthetic_hidden_states(weight, n, noise=1.5, seed=seed)
    offset = torch.nn.functional.normalize(
        torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(5)), dim=0
    )
    return hidden + 0.7 * offset * hidden.norm(dim=1, keepdim=True)


@pytest.fixture(scope="module")
def clustered():
    weight = synthetic_head(VOCAB, HIDDEN, seed=3)
    res = balanced_kmeans(weight, 16, iterations=8, progress=False)
    return weight, res


@pytest.fixture(scope="module")
def fitted(clustered):
    weight, res = clustered
    return fit_stage1(weight, res.assignments, _states(weight, 3000, seed=1), res.centroids, seed=0)


def _agreement_by_greedy(weight, centroids, assignments, hidden, n_probes, pinned):
    """Independent reference: FlashHead's greedy pick over the candidates plus the pinned ids, judged in float32."""
    head = FlashHead(weight, centroids, assignments, n_probes=n_probes)
    ids, _ = head.candidate_logits(hidden)
    if pinned:
        ids = torch.cat([ids, torch.tensor(pinned).expand(ids.shape[0], -1)], dim=1)
    reference = hidden @ weight.t()
    return float((reference.gather(1, ids).max(1).values >= reference.max(1).values).double().mean())


def test_targets_match_dense_softmax_and_do_not_depend_on_chunking():
    torch.manual_seed(0)
    v = 203  # not a multiple of 16: short clusters are padded in memory, padding must not count
    weight = torch.randn(v, 12)
    assignments = random_balanced_assignment(v, 16, seed=1)
    hidden = 2.0 * torch.randn(40, 12)
    small = cluster_targets(weight, assignments, hidden, top_k=5, chunk_bytes=1)
    big = cluster_targets(weight, assignments, hidden, top_k=5)
    for a, b in zip(vars(small).values(), vars(big).values()):
        torch.testing.assert_close(a, b)  # float sums differ in the last bit between batch shapes
    logits = hidden @ weight.t()
    c = int(assignments.max()) + 1
    log_mass = torch.stack([torch.logsumexp(logits[:, assignments == k], dim=1) for k in range(c)], dim=1)
    torch.testing.assert_close(big.log_z, torch.logsumexp(logits, dim=1))
    torch.testing.assert_close(big.top_log_mass, torch.topk(log_mass, 5, dim=1).values)
    assert torch.equal(big.winners[:, 0], assignments[logits.argmax(1)])
    assert (big.winners[:, 1:] == -1).all()  # random rows: no ties


def test_probes_needed_matches_flashhead_greedy_with_pins_and_ties(clustered):
    weight, res = clustered
    weight = weight.clone()
    hidden = _states(weight, 600, seed=11)
    dense_top = (hidden @ weight.t()).argmax(1)
    # A tie across clusters: a copy of a frequently winning row in another cluster.
    winner = int(dense_top.mode().values)
    twin = int(torch.nonzero(res.assignments != res.assignments[winner])[0])
    weight[twin] = weight[winner]
    pinned = [int(dense_top[1]), 7]
    targets = cluster_targets(weight, res.assignments, hidden, pinned_ids=pinned)
    assert (targets.winners[:, 1] >= 0).any() and targets.pinned_winner.any()
    needed = probes_needed(res.centroids, hidden, targets)
    curve = agreement_curve(needed, res.num_clusters)
    for p in (1, 3, 8, 20, res.num_clusters):
        assert float(curve[p]) == pytest.approx(
            _agreement_by_greedy(weight, res.centroids, res.assignments, hidden, p, pinned), abs=1e-12
        )
    assert float(curve[res.num_clusters]) == 1.0


def test_choose_n_probes_is_the_smallest_reaching_the_target():
    needed = torch.tensor([0] * 50 + [1] * 30 + [2] * 15 + [5] * 4 + [9])  # 100 rows, 9 clusters
    estimate = dict(confidence=0.5)  # the held-out estimate itself
    choice = choose_n_probes(needed, 9, 16, 160, target_agreement=0.95, num_pinned=2, **estimate)
    assert choice.n_probes == 2 and choice.agreement == pytest.approx(0.95) and choice.reached and choice.certified
    assert choice.scored_fraction == pytest.approx(scored_fraction(9, 2, 16, 160, 2)) == pytest.approx(43 / 160)
    assert choose_n_probes(needed, 9, 16, 160, target_agreement=0.96, **estimate).n_probes == 5
    full = choose_n_probes(needed, 9, 16, 160, target_agreement=1.0, **estimate)
    assert full.n_probes == 9 and full.agreement == 1.0 and not full.reached and full.certified
    given = choose_n_probes(needed, 9, 16, 160, target_agreement=0.96, n_probes=3, **estimate)
    assert given.n_probes == 3 and given.agreement == pytest.approx(0.95) and not given.certified
    for bad in (dict(target_agreement=1.5), dict(confidence=1.0), dict(confidence=0.3), dict(n_probes=10)):
        with pytest.raises(ValueError):
            choose_n_probes(needed, 9, 16, 160, **bad)


def test_choose_n_probes_with_confidence_needs_evidence_not_just_the_estimate():
    # 2,000 held-out rows: 12 misses at 1 probe (0.994), 8 at 2 (0.996), 2 at 3 (0.999), none at 4.
    needed = torch.tensor([1] * 1988 + [2] * 4 + [3] * 6 + [4] * 2)
    assert choose_n_probes(needed, 50, 16, 800, target_agreement=0.995, confidence=0.5).n_probes == 2
    choice = choose_n_probes(needed, 50, 16, 800, target_agreement=0.995, confidence=0.95)
    assert choice.n_probes == 3 and choice.certified and choice.agreement == pytest.approx(0.999)
    # Wilson score bound, one-sided 95%.
    z, n, p = 1.6448536269514722, 2000, 0.999
    wilson = (p + z * z / (2 * n) - z * ((p * (1 - p) + z * z / (4 * n)) / n) ** 0.5) / (1 + z * z / n)
    assert choice.agreement_lower == pytest.approx(wilson) and choice.agreement_lower >= 0.995
    # Too few rows to show 0.995 below all clusters: the estimate decides, uncertified.
    few = choose_n_probes(needed[::20], 50, 16, 800, target_agreement=0.995, confidence=0.95)
    assert few.n_probes == 1 and few.agreement == 1.0 and few.reached and not few.certified


def test_fit_raises_heldout_agreement_over_weight_only(clustered, fitted):
    weight, res = clustered
    assert fitted.best_epoch >= 1 and min(fitted.heldout_loss) < fitted.heldout_loss[0]
    unseen = _states(weight, 2000, seed=2)
    targets = cluster_targets(weight, res.assignments, unseen)
    weight_only = agreement_curve(probes_needed(res.centroids, unseen, targets), res.num_clusters)
    calibrated = agreement_curve(probes_needed(fitted.centroids, unseen, targets), res.num_clusters)
    for p in (2, 4, 8, 16):
        assert calibrated[p] > weight_only[p] + 0.05, (p, float(calibrated[p]), float(weight_only[p]))


def test_fit_is_deterministic_for_a_seed(clustered):
    weight, res = clustered
    hidden = _states(weight, 600, seed=6)
    first, again, other = (
        fit_stage1(weight, res.assignments, hidden, res.centroids, seed=seed, epochs=2) for seed in (0, 0, 1)
    )
    assert torch.equal(first.centroids, again.centroids) and torch.equal(first.heldout_rows, again.heldout_rows)
    assert not torch.equal(first.heldout_rows, other.heldout_rows)


def test_fitted_scores_stay_in_logit_units(clustered, fitted):
    """``size_c * exp(hidden @ centroid_c)`` estimates the cluster's mass: serving uses it for unprobed tokens."""
    weight, res = clustered
    unseen = _states(weight, 1000, seed=3)
    logits = unseen @ weight.t()
    log_size = torch.log(torch.bincount(res.assignments).float())
    log_mass = torch.stack(
        [torch.logsumexp(logits[:, res.assignments == k], dim=1) for k in range(res.num_clusters)], dim=1
    )
    estimate = unseen @ fitted.centroids.t() + log_size
    total_error = (torch.logsumexp(estimate, dim=1) - torch.logsumexp(logits, dim=1)).abs().median()
    heaviest = log_mass.argmax(1, keepdim=True)
    heaviest_error = (estimate.gather(1, heaviest) - log_mass.gather(1, heaviest)).abs().median()
    weight_only = (
        (torch.logsumexp(unseen @ res.centroids.t() + log_size, dim=1) - torch.logsumexp(logits, dim=1)).abs().median()
    )
    assert total_error < 2.0 and heaviest_error < 2.0, (float(total_error), float(heaviest_error))
    assert total_error < weight_only / 2


def test_fit_rejects_bad_input(clustered):
    weight, res = clustered
    hidden = _states(weight, 50, seed=1)
    with pytest.raises(ValueError, match=r"hidden states must be \[N, 32\]"):
        fit_stage1(weight, res.assignments, hidden[:, :31], res.centroids)
    with pytest.raises(ValueError, match="heldout_fraction"):
        fit_stage1(weight, res.assignments, hidden, res.centroids, heldout_fraction=1.0)
    with pytest.raises(ValueError, match="at least 2"):
        fit_stage1(weight, res.assignments, hidden[:1], res.centroids)
    bad = hidden.clone()
    bad[3, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        fit_stage1(weight, res.assignments, bad, res.centroids)
    with pytest.raises(ValueError, match="n_probes"):
        calibrate_stage1(weight, res.assignments, res.centroids, hidden, n_probes=res.num_clusters + 1)


def test_calibrate_stage1_chooses_on_heldout_and_compares_with_weight_only(clustered):
    weight, res = clustered
    hidden = _states(weight, 2000, seed=4)
    cal = calibrate_stage1(weight, res.assignments, res.centroids, hidden, target_agreement=0.9, epochs=10)
    held = hidden[cal.fit.heldout_rows]
    targets = cluster_targets(weight, res.assignments, held)
    curve = agreement_curve(probes_needed(cal.centroids, held, targets), res.num_clusters)
    lower = agreement_lower_bound(curve, held.shape[0], 0.95)
    # The rule: the bound reaches the target and the estimate shows at most half the misses it allows (margin 2).
    ok = (lower >= 0.9) & (curve >= 0.95)
    assert ok[cal.n_probes] and not ok[cal.n_probes - 1] and cal.choice.certified
    assert cal.choice.agreement == pytest.approx(float(curve[cal.n_probes]))
    assert cal.weight_only.n_probes > cal.n_probes
    assert cal.weight_only_same_probes.n_probes == cal.n_probes
    record = cal.record()
    assert record["n_probes"] == cal.n_probes and record["heldout_rows"] == 400 and record["rows"] == 2000
    assert record["weight_only_heldout_agreement"] < record["heldout_agreement"]
    assert record["target_agreement"] == 0.9 and record["confidence"] == 0.95


def test_calibrate_stage1_writes_the_count_every_validation_set_needs(clustered):
    """A validation set from another distribution that needs more probes raises the written count; its record."""
    weight, res = clustered
    hidden = _states(weight, 2000, seed=4)
    shifted = synthetic_hidden_states(weight, 1500, noise=2.5, seed=9)  # no shared offset, noisier: other text
    alone = calibrate_stage1(weight, res.assignments, res.centroids, hidden, target_agreement=0.9, epochs=10)
    both = calibrate_stage1(
        weight, res.assignments, res.centroids, hidden, target_agreement=0.9, epochs=10, validation={"shifted": shifted}
    )
    assert torch.equal(alone.centroids, both.centroids)  # validation states never reach the fit
    rows, need, at = both.validation["shifted"]
    assert rows == 1500 and need.n_probes > alone.n_probes and both.n_probes >= need.n_probes
    targets = cluster_targets(weight, res.assignments, shifted)
    curve = agreement_curve(probes_needed(both.centroids, shifted, targets), res.num_clusters)
    assert float(curve[both.n_probes]) >= 0.95 and at.agreement == pytest.approx(float(curve[both.n_probes]))
    record = both.record()
    assert record["validation"]["shifted"]["rows"] == 1500 and record["validation_rows"] == 400 + 1500
    assert record["validation_agreement_lower_bound"] >= 0.9 and record["margin"] == 2.0


# ------------------------------------------------------------------------------------ trained LM fixture


SOURCES = ("docstrings", "code")


@pytest.fixture(scope="module")
def trained():
    """The trained fixture's head clustered weight-only, then its stage 1 built three ways, as ``build`` does:
    calibrated on each source's calibration states (n_probes validated on the model's own samples too), and
    self-calibrated on the model's own samples (the default build)."""
    from tests.support.trained_fixture import load_trained_fixture

    fx = load_trained_fixture()
    res = balanced_kmeans(fx.weight, 16, iterations=20, seed=0, progress=False)
    pinned = sorted({fx.eos_id, *fx.special_ids.values()})
    builds = {
        source: calibrate_stage1(
            fx.weight,
            res.assignments,
            res.centroids,
            fx.source(source)[0],
            pinned_ids=pinned,
            seed=0,
            validation={"model samples": fx.generated},
        )
        for source in SOURCES
    }
    builds["self"] = calibrate_stage1(
        fx.weight, res.assignments, res.centroids, fx.generated, pinned_ids=pinned, seed=0
    )
    return fx, res, pinned, builds


def _largest_probes_within(fraction, num_clusters, vocab, pinned):
    return max(p for p in range(1, num_clusters + 1) if scored_fraction(num_clusters, p, 16, vocab, pinned) <= fraction)


def _shifted(build):
    """Held-out sources a build never saw: the other source, or both for the self-calibrated build."""
    return [s for s in SOURCES if s != build]


@pytest.mark.slow
@pytest.mark.parametrize(
    "build, within, target",
    [("docstrings", 0.10, 0.995), ("code", 0.10, 0.995), ("self", 0.12, 0.995), ("self", 0.12, 0.999)],
)
def test_trained_lm_stage1_meets_the_targets_on_shifted_text(trained, build, within, target):
    """Issue targets on text of another source than the calibration (fp32 reference): ``--calibration`` on one
    source >= 0.995 at <= 10 % of the rows on the other; the default (self-calibrated) build >= 0.995 at <= 12 %
    on both, and the stretch 0.999 there too.  Weight-only stage 1 does worse at the same rows."""
    fx, res, pinned, builds = trained
    vocab, c = fx.weight.shape[0], res.num_clusters
    p = _largest_probes_within(within, c, vocab, len(pinned))
    for source in _shifted(build):
        heldout = fx.source(source)[1]
        calibrated = _agreement_by_greedy(fx.weight, builds[build].centroids, res.assignments, heldout, p, pinned)
        weight_only = _agreement_by_greedy(fx.weight, res.centroids, res.assignments, heldout, p, pinned)
        assert calibrated >= target, (build, source, p, calibrated, weight_only)
        assert calibrated > weight_only, (source, weight_only)


@pytest.mark.slow
@pytest.mark.parametrize("build", ["docstrings", "code", "self"])
def test_trained_lm_builder_choice_of_n_probes_holds_on_shifted_text(trained, build):
    """The written n_probes (every validation set's estimate shows at most half the misses 0.995 allows, and the
    95 % lower bound over all of them pooled reaches 0.995) meets 0.995 on the source the build never saw, within
    the rows budget of its build kind."""
    fx, res, pinned, builds = trained
    cal = builds[build]
    vocab, c = fx.weight.shape[0], res.num_clusters
    assert cal.pooled.certified and cal.pooled.agreement_lower >= 0.995 and cal.margin == 2.0
    assert cal.choice.agreement >= 1 - 0.005 / 2
    for rows, alone, at in cal.validation.values():
        assert rows == 4096 and alone.n_probes <= cal.n_probes and at.agreement >= 1 - 0.005 / 2
    assert cal.choice.scored_fraction <= (0.12 if build == "self" else 0.10)
    assert cal.choice.scored_fraction == pytest.approx(scored_fraction(c, cal.n_probes, 16, vocab, len(pinned)))
    held = fx.source(build)[0][cal.fit.heldout_rows] if build != "self" else fx.generated[cal.fit.heldout_rows]
    curve = agreement_curve(
        probes_needed(cal.centroids, held, cluster_targets(fx.weight, res.assignments, held, pinned_ids=pinned)), c
    )
    assert float(curve[cal.n_probes]) == pytest.approx(cal.choice.agreement, abs=1e-12)
    for source in _shifted(build):
        unseen = _agreement_by_greedy(
            fx.weight, cal.centroids, res.assignments, fx.source(source)[1], cal.n_probes, pinned
        )
        assert unseen >= 0.995, (build, source, cal.n_probes, unseen)


@pytest.mark.slow
def test_trained_lm_default_build_sampled_rows_on_shifted_text(trained):
    """Sampled rows of the default (self-calibrated) build at the default sampled-row settings, on both sources
    (mean / p90 / max TV in vLLM's sampler semantics, as ``eval --json`` reports them): the issue's targets
    TV <= 0.01 at T=0.7/top_p=0.9 and <= 0.02 at T=1 hold with the tail estimate the build fits to its
    calibration states (the model's own samples); the weight-only estimate of the same rank is worse at T=1
    on both sources, even with its default of twice the exact tokens (docs/research/sampling.md)."""
    from my_pkg.flashhead.evaluate import serving_fidelity
    from my_pkg.flashhead.tail_estimate import default_tail_rank, fit_tail_factors

    fx, res, pinned, builds = trained
    cal = builds["self"]
    vocab, hidden_size = fx.weight.shape
    factors = fit_tail_factors(fx.weight, vocab, default_tail_rank(hidden_size), fx.generated)
    heads = {
        fitted: FlashHead(
            fx.weight, cal.centroids, res.assignments, n_probes=cal.n_probes, tail_factors=factors if fitted else None
        )
        for fitted in (True, False)
    }
    for source in SOURCES:
        settings = {}
        for fitted, head in heads.items():
            assert head.tail_fitted is fitted
            (result,) = serving_fidelity(head, fx.source(source)[1][:2048], [cal.n_probes], pinned=pinned)
            settings[fitted] = {(x.temperature, x.top_p): x for x in result.sampling}
            assert result.top1_agreement >= 0.995
        warm, hot = settings[True][0.7, 0.9], settings[True][1.0, 1.0]
        assert warm.tv_distance <= 0.01, (source, warm)
        assert hot.tv_distance <= 0.02, (source, hot)
        for x in (warm, hot):
            assert 0 < x.tv_p90 <= x.tv_max <= 0.2, (source, x)
        assert hot.tv_distance < 0.75 * settings[False][1.0, 1.0].tv_distance, (source, settings)


# ----------------------------------------------------------------------------------------------- CLI

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.support.tiny_model import TinyLlamaSpec, build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", TinyLlamaSpec(vocab_size=512, hidden_size=64))


@pytest.fixture(scope="module")
def calibration_text(tmp_path_factory):
    import random

    words = (
        "the of and to a in is it you that he was for on are with as his they be at one have this from or had "
        "by hot word but what some we can out other were all there when up use your how said an each she"
    ).split()
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("text") / "calibration.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(1500)))
    return path


def _build(model, *extra):
    return main(["flashhead", "build", str(model), "--no-progress", "--iterations", "4", *extra])


def test_cli_calibration_text_writes_fitted_vectors_and_chosen_probes(tiny_llama, calibration_text, tmp_path, capsys):
    weight_only, calibrated = tmp_path / "weight-only", tmp_path / "calibrated"
    assert _build(tiny_llama, "--output", str(weight_only), "--no-calibration") == 0
    assert read_config(weight_only)[CALIBRATION_KEY]["source"] == "none"
    capsys.readouterr()
    assert (
        _build(
            tiny_llama,
            "--output",
            str(calibrated),
            "--calibration",
            str(calibration_text),
            "--target-agreement",
            "0.99",
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "calibrated stage 1 on 1,500 hidden states (text)" in out

    config = read_config(calibrated)
    record = config[CALIBRATION_KEY]
    assert record["rows"] == 1500 and record["heldout_rows"] == 300 and record["source"] == "text"
    assert record["target_agreement"] == 0.99 and record["n_probes"] == config["n_probes"]
    assert record["heldout_agreement_lower_bound"] >= 0.99 and record["target_certified"] and record["target_reached"]
    assert config["architectures"] == ["FlashHeadLlamaForCausalLM"] and config["flash_head_cache_dir"] == CACHE_DIR_NAME
    # Published layout: [hidden, clusters]; same clusters as the weight-only build. The builder writes the
    # stage 1 that meets the target with fewer probes (test_stage1_choice.py): the fitted vectors, or the
    # weight-only build's own.
    cache, base = (load_file(str(d / CACHE_DIR_NAME / CACHE_FILE_NAME)) for d in (calibrated, weight_only))
    assert cache["centroids"].shape == base["centroids"].shape == (64, 32)
    assert torch.equal(cache["cluster_assignments"], base["cluster_assignments"])
    variants = record["stage1_variants"]
    kept, other = variants[record["stage1"]], variants[({"calibrated", "weight_only"} - {record["stage1"]}).pop()]
    assert kept["n_probes_needed"] == record["n_probes"] and kept["meets_target"]
    assert kept["n_probes_needed"] <= other["n_probes_needed"] or not other["meets_target"]
    if record["stage1"] == "weight_only":
        assert torch.equal(cache["centroids"], base["centroids"])
    else:
        assert not torch.allclose(cache["centroids"], base["centroids"])
    centroids, _ = load_assets(calibrated, config)
    assert torch.equal(centroids, cache["centroids"].t())
    # Sampled rows' tail estimate is fitted to the same states; a weight-only build has none.
    assert "fitted the rank-8 tail estimate of sampled rows" in out
    assert record["tail_estimate"] == {"rank": 8, "states": 1500}
    factors = load_tail_factors(calibrated, config)
    assert factors is not None and factors.rank == 8 and factors.left.shape == (64, 8)
    assert load_tail_factors(weight_only, read_config(weight_only)) is None

    # Rebuilding weight-only in place replaces the record and removes the fitted estimate.
    assert _build(calibrated, "--no-calibration") == 0
    assert read_config(calibrated)[CALIBRATION_KEY] == {"source": "none", "reason": "--no-calibration"}
    assert load_tail_factors(calibrated, read_config(calibrated)) is None


def test_cli_calibration_hidden_file_and_explicit_probes(tiny_llama, tmp_path, capsys):
    from my_pkg.flashhead.assets import load_lm_head

    weight, _ = load_lm_head(tiny_llama)
    states = tmp_path / "states.safetensors"
    save_file({"hidden_states": synthetic_hidden_states(weight, 400, noise=1.0, seed=2)}, str(states))
    out_dir = tmp_path / "out"
    assert _build(tiny_llama, "--output", str(out_dir), "--calibration-hidden", str(states), "--n-probes", "5") == 0
    config = read_config(out_dir)
    assert config["n_probes"] == 5
    record = config[CALIBRATION_KEY]
    assert record["n_probes"] == 5 and record["rows"] == 400 and record["source"] == "hidden_states"
    assert "held-out top-1 agreement at n_probes=5" in capsys.readouterr().out


@pytest.mark.parametrize(
    "case", ["missing text", "empty text", "missing states", "wrong hidden size", "too few states", "not safetensors"]
)
def test_cli_calibration_bad_input_writes_nothing(tiny_llama, tmp_path, capsys, case):
    states = tmp_path / "states.safetensors"
    if case == "empty text":
        (tmp_path / "empty.txt").write_text("  \n")
        extra = ["--calibration", str(tmp_path / "empty.txt")]
    elif case == "missing text":
        extra = ["--calibration", str(tmp_path / "nope.txt")]
    elif case == "missing states":
        extra = ["--calibration-hidden", str(tmp_path / "nope.safetensors")]
    elif case == "not safetensors":
        states.write_bytes(b"garbage")
        extra = ["--calibration-hidden", str(states)]
    else:
        rows, width = (100, 63) if case == "wrong hidden size" else (5, 64)
        save_file({"hidden_states": torch.randn(rows, width)}, str(states))
        extra = ["--calibration-hidden", str(states)]
    expected = {
        "missing text": "cannot read calibration text",
        "empty text": "is empty",
        "missing states": "not found",
        "not safetensors": "cannot read calibration hidden states",
        "wrong hidden size": "must be [N, 64]",
        "too few states": "at least 20",
    }[case]
    out_dir = tmp_path / "out"
    before = (tiny_llama / "config.json").read_text()
    assert _build(tiny_llama, "--output", str(out_dir), *extra) == 1
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert not out_dir.exists()
    assert (tiny_llama / "config.json").read_text() == before and not (tiny_llama / CACHE_DIR_NAME).exists()


def test_cli_calibration_sources_are_exclusive_and_target_validated(tiny_llama, calibration_text, capsys):
    with pytest.raises(SystemExit) as exc:
        _build(tiny_llama, "--calibration", str(calibration_text), "--calibration-hidden", "x.safetensors")
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _build(tiny_llama, "--calibration", str(calibration_text), "--target-agreement", "1.2")
    assert "must lie in (0, 1]" in capsys.readouterr().err
    assert json.loads((tiny_llama / "config.json").read_text()).get("n_probes") is None


# ------------------------------------------------------------------------------------------ self-calibration


@pytest.fixture(scope="module")
def tiny_lm(tiny_llama):
    from my_pkg.flashhead.calibration import load_causal_lm

    return load_causal_lm(tiny_llama)


def test_self_calibration_states_are_seeded_and_reproduce_the_logits(tiny_lm):
    from my_pkg.flashhead.calibration import SELF_CALIBRATION_PROMPTS, generate_calibration_states

    model, tokenizer = tiny_lm
    first, again, other = (
        generate_calibration_states(model, tokenizer, max_states=150, new_tokens=8, seed=seed) for seed in (0, 0, 1)
    )
    assert first.hidden.shape == (150, 64) and torch.equal(first.hidden, again.hidden)
    assert not torch.equal(first.hidden, other.hidden)
    assert first.rounds == -(-150 // (len(SELF_CALIBRATION_PROMPTS) * 8)) and not first.stopped_by_time
    record = first.record()
    assert record["states"] == 150 and record["seed"] == 0 and record["new_tokens"] == 8
    # BOS alone: the first state is the model's final hidden state after BOS.
    bos = torch.tensor([[tokenizer.bos_token_id]])
    with torch.no_grad():
        expected = model(bos, output_hidden_states=True).hidden_states[-1][0, -1]
    torch.testing.assert_close(first.hidden[0], expected, rtol=1e-4, atol=1e-4)


def test_self_calibration_stops_at_eos_and_at_the_time_budget(tiny_lm):
    from my_pkg.flashhead.calibration import generate_calibration_states

    model, tokenizer = tiny_lm
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = list(range(model.config.vocab_size))  # every token ends a sequence
    try:
        ended = generate_calibration_states(model, tokenizer, max_states=70, new_tokens=8, prompts=("", "the", "of"))
    finally:
        model.generation_config.eos_token_id = saved
    assert ended.hidden.shape[0] == 70 and ended.rounds == 24  # one state per sequence: 3 per round
    quick = generate_calibration_states(model, tokenizer, max_states=10**6, new_tokens=8, time_budget_s=0.05)
    assert quick.stopped_by_time and 0 < quick.hidden.shape[0] < 10**6


def test_cli_default_build_self_calibrates_and_records_it(tiny_llama, tmp_path, capsys):
    out_dir = tmp_path / "default"
    assert _build(tiny_llama, "--output", str(out_dir), "--self-calibration-states", "600") == 0
    out = capsys.readouterr().out
    assert "self-calibration: sampling the model" in out and "calibrated stage 1 on 600 hidden states (self)" in out
    record = read_config(out_dir)[CALIBRATION_KEY]
    assert record["source"] == "self" and record["rows"] == 600
    assert record["self_calibration"]["states"] == 600 and record["self_calibration"]["seed"] == 0
    assert _build(tiny_llama, "--output", str(tmp_path / "none"), "--no-calibration") == 0
    assert read_config(tmp_path / "none")[CALIBRATION_KEY] == {"source": "none", "reason": "--no-calibration"}
    with pytest.raises(SystemExit):
        _build(tiny_llama, "--no-calibration", "--calibration", "x.txt")


def test_cli_default_build_of_a_head_only_checkpoint_is_weight_only_with_a_warning(make_model, capsys):
    path, _ = make_model(256, 32)
    assert _build(path) == 0
    out = capsys.readouterr().out
    assert "warning: no self-calibration, cannot run the model" in out
    record = read_config(path)[CALIBRATION_KEY]
    assert record["source"] == "none" and record["reason"].startswith("cannot run the model")
