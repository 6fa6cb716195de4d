"""`bench/top_p.py` on small shapes: both functions timed, the same mask, and the section written."""

from __future__ import annotations

from bench import top_p


def test_both_functions_are_timed_on_the_same_mask(tmp_path, monkeypatch, capsys):
    written = {}
    monkeypatch.setattr(top_p, "write_section", lambda name, md: written.setdefault(name, md) and tmp_path)
    assert top_p.main(["--vocabs", "4096", "--batches", "1,3", "--repeats", "1", "--rounds", "1"]) == 0
    table = written["top-p"]
    rows = [line for line in table.splitlines() if line.startswith("| 4,096 |")]
    assert len(rows) == 2 and all(line.rstrip().endswith("| yes |") for line in rows)
    assert "Command: `python -m" in table


def test_the_logits_are_peaked_and_tempered():
    logits = top_p.peaked_logits(2, 1000)
    raised = (logits > 12.0 / top_p.TEMPERATURE * 0.5).sum(dim=1)
    assert logits.shape == (2, 1000) and (raised >= top_p.RAISED * 0.8).all() and (raised < 100).all()
