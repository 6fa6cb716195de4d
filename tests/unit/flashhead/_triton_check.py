"""Run by test_triton_kernels.py in a subprocess with TRITON_INTERPRET=1 set before triton loads.

Compares the Triton kernels (CPU interpreter) with the torch path; exits non-zero on mismatch.
"""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"

import torch  # noqa: E402

from my_pkg.flashhead import FlashHead  # noqa: E402
from my_pkg.flashhead.clustering import random_balanced_assignment  # noqa: E402

ATOL = 1e-4  # fp32 dot products of length <= 200 summed in a different order

failures = []
for vocab, hidden, pad, batch, seed in [(200, 200, 3, 1, 0), (333, 37, 0, 3, 1), (64, 129, 2, 2, 2)]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab + pad, hidden, generator=g)
    assign = random_balanced_assignment(vocab, 16, seed=seed)
    c = int(assign.max()) + 1
    cent = torch.randn(c, hidden, generator=g)
    ref = FlashHead(w, cent, assign, vocab_size=vocab, n_probes=min(3, c), backend="torch")
    tri = FlashHead(w, cent, assign, vocab_size=vocab, n_probes=min(3, c), backend="triton")
    h = torch.randn(batch, hidden, generator=g)
    for probes in (ref.select_probes(h), ref.select_probes(h, n_probes=c)):
        i1, l1 = ref.candidate_logits(h, probes)
        i2, l2 = tri.candidate_logits(h, probes)
        if not torch.equal(i1, i2):
            failures.append(f"ids differ {vocab}x{hidden}")
        if l2.dtype != l1.dtype or (l1 - l2).abs().max() > ATOL:
            failures.append(f"logits differ {vocab}x{hidden}: {(l1 - l2).abs().max()}")
        g1, g2 = ref.greedy(h, probes), tri.greedy(h, probes)
        if not torch.equal(g1, g2):
            failures.append(f"greedy differs {vocab}x{hidden}: {g1} vs {g2}")
    tri.n_probes = c
    if not torch.equal(tri.greedy(h), tri.dense_logits(h).argmax(1)):
        failures.append("full-probe greedy != dense argmax")

# Ties and negative logits: smallest token id wins; all-negative logits handled by the packing.
w = torch.zeros(48, 4)
w[:, 0] = -torch.arange(48, dtype=torch.float32) - 1.0
w[20, 0] = w[9, 0] = w[40, 0] = -0.5
head = FlashHead(w, torch.randn(3, 4), torch.arange(48) % 3, n_probes=3, backend="triton")
got = head.greedy(torch.tensor([[1.0, 0, 0, 0]])).tolist()
if got != [9]:
    failures.append(f"tie rule: {got}")

print("\n".join(failures) if failures else "triton interpreter: all checks passed")
sys.exit(1 if failures else 0)
