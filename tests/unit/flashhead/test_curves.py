"""The fidelity curves ``eval --plot`` draws: the probe counts, the sweeps, the head left as it was."""

from my_pkg.flashhead.curves import fidelity_curves, plot_probe_counts
from my_pkg.flashhead.fidelity import serving_fidelity


def test_plot_probe_counts_cover_the_served_count_and_stay_within_the_clusters():
    assert plot_probe_counts(32, 5) == [1, 2, 4, 5, 8, 16, 32]
    assert plot_probe_counts(4000, 100, [3]) == [1, 2, 3, 4, 8, 16, 32, 64, 100, 128, 256, 512]
    assert max(plot_probe_counts(6, 6)) == 6


def test_fidelity_curves_sweep_probes_and_ranks_and_restore_the_head(head_and_states):
    head, hidden = head_and_states
    curves = fidelity_curves(head, hidden, [1, 4, head.num_clusters])
    assert [r.n_probes for r in curves.greedy] == [1, 4, head.num_clusters]
    agreement = [r.top1_agreement for r in curves.greedy]
    assert agreement == sorted(agreement) and agreement[-1] == 1.0  # every cluster probed: exact
    assert all(not r.sampling for r in curves.greedy)
    # The sweep's greedy figures are serving_fidelity's (one dense pass per batch instead of one per count).
    reference = serving_fidelity(head, hidden, [1, 4, head.num_clusters])
    for swept, served in zip(curves.greedy, reference):
        assert swept.n_probes == served.n_probes and swept.top1_agreement == served.top1_agreement
        assert swept.top5_agreement == served.top5_agreement and swept.scored_fraction == served.scored_fraction
    assert [r.sampled_rank for r in curves.sampled] == [2, 4, 6, 8] and curves.served_rank == 8
    assert head.sampled_rank == 8 and head.n_probes == 4 and curves.served_n_probes == 4
    # A lower rank scores fewer rows per sampled row and gives a larger TV distance at T=1.
    fractions = [r.sampling[1].scored_fraction for r in curves.sampled]
    tv = [r.sampling[1].tv_distance for r in curves.sampled]
    assert fractions == sorted(fractions) and tv[0] > tv[-1]
