import pytest
import torch

from my_pkg.flashhead import FlashHead, balanced_kmeans
from my_pkg.flashhead.cluster_rows import build_members
from my_pkg.flashhead.clustering import cluster_capacities, random_balanced_assignment
from tests.support.heads import random_head

from .conftest import clustered_head


@pytest.mark.parametrize("vocab,size", [(320, 16), (333, 16), (40, 16), (100, 7)])
def test_balanced_sizes(vocab, size):
    w = clustered_head(vocab, 12)
    res = balanced_kmeans(w, size, iterations=5, progress=False, pca_dim=8)
    counts = torch.bincount(res.assignments, minlength=res.num_clusters)
    assert res.num_clusters == -(-vocab // size)
    assert res.assignments.shape == (vocab,) and counts.sum() == vocab
    assert counts.max() <= size and counts.max() - counts.min() <= 1
    if vocab % size == 0:
        assert (counts == size).all()
    assert res.centroids.shape == (res.num_clusters, 12)


def test_clustering_deterministic_and_better_than_random():
    w = clustered_head(480, 16, seed=1)
    a = balanced_kmeans(w, 16, iterations=8, seed=5, progress=False)
    b = balanced_kmeans(w, 16, iterations=8, seed=5, progress=False)
    assert torch.equal(a.assignments, b.assignments) and torch.equal(a.centroids, b.centroids)
    x = torch.nn.functional.normalize(w, dim=1)

    def cohesion(assign):
        cent = torch.zeros(30, 16).index_add_(0, assign, x)
        return float((torch.nn.functional.normalize(cent, dim=1)[assign] * x).sum(1).mean())

    assert cohesion(a.assignments) > cohesion(random_balanced_assignment(480, 16)) + 0.2


def test_capacities():
    assert cluster_capacities(32, 16).tolist() == [16, 16]
    assert cluster_capacities(20, 16).tolist() == [10, 10]
    assert cluster_capacities(33, 16).tolist() == [11, 11, 11]


def test_build_members_pads_with_own_member():
    assign = torch.tensor([0, 1, 0, 1, 1, 2, 2, 2])
    m = build_members(assign)
    assert m.shape == (3, 3)
    for c in range(3):
        assert set(m[c].tolist()) == set(torch.nonzero(assign == c).flatten().tolist())
    with pytest.raises(ValueError):
        build_members(torch.tensor([0, 2]))  # cluster 1 empty


def _head(vocab=333, hidden=37, pad=5, n_probes=4, seed=0, dtype=torch.float32):
    return random_head(vocab, hidden, pad=pad, n_probes=n_probes, dtype=dtype, seed=seed, centroids="random")


@pytest.mark.parametrize("batch", [1, 5])
def test_full_probes_equal_dense(batch):
    head, g = _head()
    head.n_probes = head.num_clusters
    h = torch.randn(batch, head.hidden_size, generator=g)
    dense = head.dense_logits(h)
    assert dense.shape == (batch, 333)
    sparse = head.step_logits(h)
    assert torch.equal(sparse.argmax(1), dense.argmax(1))
    assert torch.isfinite(sparse).all()
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)
    ids, logits = head.candidate_logits(h)
    assert ids.shape == (batch, head.num_clusters * 16) and ids.dtype == torch.int64
    assert int(ids.max()) < 333  # padded rows of the weight are never candidates


def test_partial_probes_exact_on_candidates():
    head, g = _head(n_probes=3)
    h = torch.randn(4, head.hidden_size, generator=g)
    probes = head.select_probes(h)
    assert probes.shape == (4, 3)
    scores = h @ head.centroids.t()
    assert torch.equal(probes.sort(1).values, scores.topk(3, dim=1).indices.sort(1).values)
    ids, logits = head.candidate_logits(h, probes)
    dense = head.dense_logits(h)
    torch.testing.assert_close(logits, dense.gather(1, ids))
    sparse = head.step_logits(h)
    assert int(torch.isfinite(sparse).sum(1).max()) <= 3 * 16
    best = torch.where(torch.isfinite(sparse), dense, torch.full_like(dense, -1e30)).argmax(1)
    assert torch.equal(sparse.argmax(1), best)


def test_greedy_tie_rule_smallest_id():
    w = torch.zeros(40, 4)
    w[7] = w[3] = w[30] = torch.tensor([1.0, 0, 0, 0])
    assign = torch.arange(40) % 3
    head = FlashHead(w, torch.randn(3, 4), assign, n_probes=3)
    assert head.step_logits(torch.tensor([[1.0, 0, 0, 0]])).argmax(1).tolist() == [3]


def test_n_probes_validation_and_properties():
    head, _ = _head()
    assert (head.num_clusters, head.cluster_size, head.vocab_size, head.hidden_size) == (21, 16, 333, 37)
    assert head.backend == "torch"
    for bad in (0, head.num_clusters + 1, 2.5, True):
        with pytest.raises(ValueError):
            head.n_probes = bad
    head.n_probes = 7
    assert head.select_probes(torch.randn(2, 37)).shape == (2, 7)
    with pytest.raises(ValueError):
        head.select_probes(torch.randn(2, 37), n_probes=0)
    with pytest.raises(ValueError):
        FlashHead(torch.randn(10, 4), torch.randn(2, 4), torch.arange(12) % 2, n_probes=1)  # vocab > rows
    with pytest.raises(ValueError):
        FlashHead(torch.randn(10, 4), torch.randn(2, 4), torch.arange(10) % 2, n_probes=1, backend="bogus")


def test_extra_memory_small():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 256, generator=g)
    assign = random_balanced_assignment(4096, 16)
    head = FlashHead(w, torch.randn(256, 256, generator=g), assign, n_probes=8, cluster_rows=False)
    head_bytes = w.numel() * w.element_size()
    assert head.extra_memory_bytes == 256 * 256 * 4 + 4096 * 8 + 4096 * 8  # centroids, cluster map, row -> cluster
    assert head.extra_memory_bytes <= head_bytes / 8
    assert head.weight.data_ptr() == w.data_ptr()  # a reference, not a copy
    # By default a CPU head also holds its token rows in cluster order and four [V] int64 maps (that copy's
    # order, each token's row, the cluster map in its rows, each row's cluster), but no [V'] row -> cluster.
    copied = FlashHead(w, torch.randn(256, 256, generator=g), assign, n_probes=8)
    assert copied.extra_memory_bytes == 256 * 256 * 4 + 4096 * 8 + head_bytes + 4 * 4096 * 8


def test_bf16_head():
    head, g = _head(dtype=torch.bfloat16, n_probes=21)
    h = torch.randn(3, head.hidden_size, generator=g)
    ids, logits = head.candidate_logits(h)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(head.step_logits(h).float(), head.dense_logits(h).float(), rtol=2e-2, atol=5e-2)
