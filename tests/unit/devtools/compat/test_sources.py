"""my_pkg.devtools.compat.sources: a fetched wheel is cached and reused; unreadable sources end the command with 2."""

from __future__ import annotations

from my_pkg.devtools.compat import fetch_wheel, main

from .conftest import FAKE_SOURCES, write_wheel


def test_a_cached_wheel_is_reused_without_downloading(tmp_path, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    cached = write_wheel(cache / "vllm-9.9.9-py3-none-any.whl", FAKE_SOURCES)
    assert fetch_wheel("9.9.9", cache) == cached
    assert main(["--vllm-version", "9.9.9", "--cache-dir", str(cache)]) == 1  # the fake lacks the engine's symbols
    out = capsys.readouterr().out
    assert "downloading" not in out and f"vLLM 9.9.9 from {cached}" in out


def test_unreadable_sources_exit_2_with_a_message(tmp_path, capsys):
    not_a_wheel = tmp_path / "vllm-1.0.0-py3-none-any.whl"
    not_a_wheel.write_text("not a zip")
    assert main(["--wheel", str(not_a_wheel)]) == 2
    assert "cannot open" in capsys.readouterr().err
    empty = write_wheel(tmp_path / "empty.whl", {"other/__init__.py": ""})
    assert main(["--wheel", str(empty)]) == 2
    assert "holds no vllm package" in capsys.readouterr().err
