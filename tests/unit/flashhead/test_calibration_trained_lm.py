"""Stage 1 of the trained fixture's LM (tests/support/trained_fixture.py), built as ``build`` builds it, on text
of a source the calibration never saw: top-1 agreement, the written probe count and sampled rows.  Slow."""

import pytest

from my_pkg.flashhead import FlashHead
from my_pkg.flashhead.calibration import (
    agreement_curve,
    calibrate_stage1,
    cluster_targets,
    probes_needed,
    scored_fraction,
)
from my_pkg.flashhead.clustering import balanced_kmeans

from .conftest import greedy_agreement

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
        calibrated = greedy_agreement(fx.weight, builds[build].centroids, res.assignments, heldout, p, pinned)
        weight_only = greedy_agreement(fx.weight, res.centroids, res.assignments, heldout, p, pinned)
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
        unseen = greedy_agreement(fx.weight, cal.centroids, res.assignments, fx.source(source)[1], cal.n_probes, pinned)
        assert unseen >= 0.995, (build, source, cal.n_probes, unseen)


@pytest.mark.slow
def test_trained_lm_default_build_sampled_rows_on_shifted_text(trained):
    """Sampled rows of the default (self-calibrated) build at the default sampled-row settings, on both sources
    (mean / p90 / max TV in vLLM's sampler semantics, as ``eval --json`` reports them): the issue's targets
    TV <= 0.01 at T=0.7/top_p=0.9 and <= 0.02 at T=1 hold with the tail estimate the build fits to its
    calibration states (the model's own samples); the weight-only estimate of the same rank is worse at T=1
    on both sources, even with its default of twice the exact tokens (docs/research/sampling.md)."""
    from my_pkg.flashhead.fidelity import serving_fidelity
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
