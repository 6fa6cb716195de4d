"""`bench/experiments/centroid_layout.py` on a tiny head: both layouts timed, for stage 1 and for served steps."""

from __future__ import annotations

import argparse

from bench.experiments import centroid_layout


def test_both_layouts_are_timed_for_stage_1_and_each_kind_of_step():
    args = argparse.Namespace(dtype="float32", batches=[1, 8], repeats=1, rounds=2)
    results = centroid_layout.run_shape(1024, 32, args)
    assert [r["batch"] for r in results] == [1, 8]
    for row in results:
        names = ["dense"] + [
            f"{part} {layout}" for part in ("stage 1", "greedy", "sampled") for layout in centroid_layout.LAYOUTS
        ]
        assert all(row[name] > 0 for name in names)


def test_shapes_are_read_as_vocabulary_by_hidden_pairs():
    assert centroid_layout.shape_list("128256x2048, 262144X640") == [(128256, 2048), (262144, 640)]
