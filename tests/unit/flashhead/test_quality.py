from my_pkg.flashhead import FlashHead, balanced_kmeans
from my_pkg.flashhead.clustering import random_balanced_assignment, score_centroids
from my_pkg.flashhead.evaluate import evaluate
from my_pkg.flashhead.synthetic import synthetic_head, synthetic_hidden_states


def test_clustered_head_beats_random_clustering():
    w = synthetic_head(4096, 64, seed=3)
    hidden = synthetic_hidden_states(w, 400, seed=4)
    res = balanced_kmeans(w, 16, iterations=10, progress=False, pca_dim=32)
    good = FlashHead(w, res.centroids, res.assignments, n_probes=16)
    rnd_assign = random_balanced_assignment(4096, 16)
    rnd = FlashHead(w, score_centroids(w, rnd_assign, 256), rnd_assign, n_probes=16)
    (g16, g256), _ = evaluate(good, hidden, [16, 256], time_repeats=1)
    (r16,), _ = evaluate(rnd, hidden, [16], time_repeats=1)
    assert g256.top1 == 1.0 and g256.top5_in == 1.0  # every cluster probed: exact
    assert g16.top1 >= 0.8, g16
    assert g16.top1 > r16.top1 + 0.3, (g16, r16)
    assert g16.scored_rows == 256 + 16 * 16
    assert g16.ms > 0 and g16.sampled_ms > 0  # step_logits timed at batch 1, greedy and sampled


def test_eval_counts_a_tie_with_the_dense_maximum_as_agreement():
    """Tokens 0 and 7 have the same row; FlashHead probes only token 7's cluster and picks it.

    The dense argmax returns the lower index (0), but token 7's logit *is* the maximum: a
    tie, which must count as agreement (an index comparison would report 0%).
    """
    import torch

    target = torch.tensor([1.0, 0.0, 0.0, 0.0])
    weight = torch.stack(
        [
            target,
            -target,
            -target + 0.1,
            -target - 0.1,  # cluster 0
            0.5 * target,
            0.4 * target + 0.1,
            0.3 * target - 0.1,
            target.clone(),  # cluster 1
        ]
    )
    assignments = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    centroids = score_centroids(weight, assignments, 2)
    head = FlashHead(weight, centroids, assignments, n_probes=1, backend="torch")
    hidden = target.repeat(3, 1)
    assert head.step_logits(hidden).argmax(1).tolist() == [7, 7, 7]
    (row,), _ = evaluate(head, hidden, [1], time_repeats=1)
    assert row.top1 == 1.0
