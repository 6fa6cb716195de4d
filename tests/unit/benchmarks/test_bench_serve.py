"""`bench/serve.py` without a server: greedy and sampled bodies, paired-round ratios, the row check, the targets."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench._load import LoadResult, RowCounts, completion_body
from bench.serve import (
    Measurement,
    ShapeResult,
    SpecVariant,
    _traffics,
    parse_args,
    planned_seconds,
    shapes,
    spec_variants,
    table,
    targets,
)


def test_sampled_traffic_samples_at_the_common_defaults():
    greedy, sampled = completion_body("m", "p", 8), completion_body("m", "p", 8, "sampled")
    assert greedy["temperature"] == 0 and "top_p" not in greedy
    assert sampled["temperature"] == 0.7 and sampled["top_p"] == 0.9
    assert greedy["ignore_eos"] and sampled["ignore_eos"] and sampled["max_tokens"] == 8
    assert _traffics("sampled, greedy,sampled") == ["sampled", "greedy"]
    with pytest.raises(argparse.ArgumentTypeError):
        _traffics("beam")


def _m(mode, traffic, rnd, tok_per_s, flash_rows=0, dense=None):
    load = LoadResult(1, requests=2, completion_tokens=int(tok_per_s * 10), wall_s=10.0)
    return Measurement(mode, traffic, rnd, load, RowCounts(flash_rows, dense or {}))


def _result(key, ratios_by_round, **rows):
    result = ShapeResult(shapes(4)[key], 8, 16, True, 100, None, "torch")
    for traffic in ("greedy", "sampled"):
        result.runs[(traffic, 1)] = [
            m
            for rnd, ratio in enumerate(ratios_by_round[traffic])
            for m in (
                _m("dense", traffic, rnd, 10.0),
                _m("flashhead", traffic, rnd, 10.0 * ratio, 5, rows.get(traffic)),
            )
        ]
    return result


def test_paired_rounds_give_the_median_ratio_and_its_spread():
    result = _result("head-heavy", {"greedy": [2.0, 3.0, 2.5], "sampled": [1.0, 1.2, 0.9]})
    assert result.median_ratio(("greedy", 1)) == pytest.approx(2.5)
    rows = table(result)
    assert "| 1 | greedy | 10.0 | 25.0 | 2.50x | 2.00..3.00 | 100% | ok |" in rows
    assert "| 1 | sampled | 10.0 | 10.3 | 1.00x | 0.90..1.20 | 100% | ok |" in rows


def test_a_sampled_row_sent_dense_for_what_its_request_asked_fails_the_check():
    result = _result(
        "quick", {"greedy": [1.5], "sampled": [1.5]}, sampled={"unclassified": 3}, greedy={"batch_threshold": 2}
    )
    assert result.all_checked(("greedy", 1))  # a step over the threshold is dense by design
    assert not result.all_checked(("sampled", 1))
    assert not _m("dense", "greedy", 0, 10.0, flash_rows=1).check


def test_targets_say_whether_they_were_met():
    met = {goal: ok for goal, _, ok in targets([_result("head-heavy", {"greedy": [2.3], "sampled": [2.25]})])}
    assert met == {
        "≥ 2.2x dense at C = 1, head-heavy": True,
        "≥ 1.0x dense at every concurrency, greedy and sampled": True,
    }
    met = targets([_result("llama-1b", {"greedy": [2.0], "sampled": [0.95]})])
    assert [(goal, ok) for goal, _, ok in met] == [
        ("≥ 1.8x dense at C = 1, llama-1b", False),
        ("≥ 1.0x dense at every concurrency, greedy and sampled", False),
    ]
    assert "lowest 0.95x (llama-1b, sampled, C = 1)" in met[1][1]


def test_spec_runs_one_server_per_variant_each_against_dense():
    from pathlib import Path

    flash, base = Path("/m/x-flashhead"), Path("/m/x")
    assert spec_variants(None, flash, base) == [SpecVariant("", {})]
    (ngram,) = spec_variants("ngram", flash, base)
    assert ngram.label == "FlashHead verify" and ngram.config["method"] == "ngram"
    assert ngram.config["num_speculative_tokens"] == 3
    verify, both = spec_variants("draft", flash, base)
    assert (verify.label, verify.config["model"]) == ("FlashHead verify", str(base))  # no assets: a dense drafter
    assert (both.label, both.config["model"]) == ("FlashHead verify + draft", str(flash))
    assert verify.config["method"] == both.config["method"] == "draft_model"
    (eagle,) = spec_variants("eagle", flash, base)  # a head built for the shape, beside its checkpoint
    assert (eagle.config["method"], eagle.config["model"]) == ("eagle", "/m/x-eagle") and eagle.flashhead_drafts
    with pytest.raises(ValueError):
        spec_variants("medusa", flash, base)


def test_spec_rounds_check_that_verify_and_draft_rows_went_where_the_mode_says():
    load = LoadResult(1, requests=2, completion_tokens=100, wall_s=10.0)

    def m(mode, verify, draft, *, drafted=30.0, flashhead_drafts=True):
        rows = RowCounts(0 if mode == "dense" else 50, {}, verify, draft)
        return Measurement(mode, "greedy", 0, load, rows, 20.0, drafted, flashhead_drafts)

    assert m("flashhead", verify=40, draft=90).check
    assert not m("flashhead", verify=40, draft=0).check  # the drafter's head stayed dense
    assert m("flashhead", verify=40, draft=0, flashhead_drafts=False).check  # a dense drafter by design
    assert not m("flashhead", verify=0, draft=90).check  # drafts were verified, but not by FlashHead
    assert m("dense", verify=0, draft=0).check
    assert not m("dense", verify=0, draft=3).check  # a dense round must not draft with FlashHead
    assert not m("dense", verify=2, draft=0).check
    _, both = spec_variants("draft", Path("x-flashhead"), Path("x"))
    assert both.flashhead_drafts and not spec_variants("ngram", Path("x-flashhead"), Path("x"))[0].flashhead_drafts


def test_spec_arguments_default_to_concurrency_1_and_8_and_print_only():
    plain, ngram, draft = parse_args([]), parse_args(["--spec", "ngram"]), parse_args(["--spec", "draft"])
    assert plain.spec is None and plain.concurrency == [1, 8, 32]
    assert ngram.spec == "ngram" and ngram.concurrency == [1, 8] == draft.concurrency
    assert parse_args(["--spec", "draft", "--concurrency", "4"]).concurrency == [4]
    assert planned_seconds(draft, 1) == 2 * planned_seconds(ngram, 1) == 2 * planned_seconds(plain, 1) * 2 / 3
    for argv in (["--spec", "draft", "--write-docs"], ["--spec", "medusa"]):
        with pytest.raises(SystemExit):
            parse_args(argv)


def test_a_tensor_parallel_server_binds_a_core_per_rank_and_prints_only(tmp_path):
    from bench._load import flashhead_server

    assert parse_args([]).tensor_parallel_size == 1
    assert parse_args(["--tensor-parallel-size", "2"]).tensor_parallel_size == 2
    for argv in (["--tensor-parallel-size", "2", "--write-docs"], ["--tensor-parallel-size", "0"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    extra = ["--tensor-parallel-size", "2"]
    server = flashhead_server(
        tmp_path, tmp_path / "log", max_model_len=128, max_num_seqs=8, extra_args=extra, tensor_parallel_size=2
    )
    assert server.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and "--tensor-parallel-size" in server.args
    alone = flashhead_server(tmp_path, tmp_path / "log", max_model_len=128, max_num_seqs=8)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in alone.env


def test_a_spec_table_reports_each_modes_acceptance():
    result = _result("quick", {"greedy": [1.2], "sampled": [1.1]})
    result.variant = SpecVariant("FlashHead verify + draft", {"method": "draft_model"})
    for m in result.runs[("greedy", 1)]:
        m.accepted, m.drafted = (30.0, 60.0) if m.mode == "dense" else (57.0, 60.0)
        if m.mode == "flashhead":  # FlashHead verified the drafts
            m.rows = RowCounts(m.rows.flashhead, m.rows.dense, verify=80)
    rows = table(result)
    assert "acceptance dense | acceptance FlashHead |" in rows[0] and rows[1].count("|") == rows[0].count("|")
    assert "| 1 | greedy | 10.0 | 12.0 | 1.20x | 1.20..1.20 | 100% | 0.500 | 0.950 | ok |" in rows
    assert "| 1 | sampled | 10.0 | 11.0 | 1.10x | 1.10..1.10 | 100% | nan | nan | ok |" in rows
    assert targets([]) == []
