"""Test support shared by the tests, the benchmarks and the demo (not part of the wheel).

`tiny_model` builds small models locally (no model hub), `server` runs a real vLLM
OpenAI server in a subprocess (the deprecated single-API-server entry point, or
vLLM's `serve` subcommand with its multi-process topology), `trained_fixture` makes
and loads `tests/assets/trained_lm`, and `demo` is what `make demo` runs. Import them
as `tests.support.*` from the repository root (`python -m ...` or pytest).
"""
