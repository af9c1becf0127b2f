# Two commands on a fresh clone: `make demo` (the main job) and `make test`. Each creates .venv
# and installs what it needs. torch is installed first at the pinned CPU version, then everything
# else under a constraints file so the resolver can never swap in a CUDA build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements-dev.txt 2>/dev/null | cksum | cut -d' ' -f1)

.PHONY: install test lint demo clean

$(STAMP):
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip freeze | grep -i '^torch==' > $(VENV)/constraints.txt
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -e '.[train,dev]' -r requirements-dev.txt
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

demo: $(STAMP)
	$(BIN)/tracerl demo

clean:
	rm -rf $(VENV) tracerl-store
