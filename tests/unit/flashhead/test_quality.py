from my_pkg.flashhead import FlashHead, balanced_kmeans
from my_pkg.flashhead.clustering import random_balanced_assignment, score_centroids
from my_pkg.flashhead.evaluate import evaluate, synthetic_head, synthetic_hidden_states


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
