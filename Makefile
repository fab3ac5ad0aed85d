# torch-contrastive: every target sets itself up (.venv, CPU torch wheel first).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench mutate setup clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel first: a bare "torch" requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,cli,gpu,docs]'
	# Test-only peers whose packages import torchvision or heavy stacks: no deps; tests load open_clip's loss.py, lightly's dcl_loss.py and LibAUC's losses/contrastive.py alone.
	$(BIN)/pip install -q --no-deps open_clip_torch==3.3.0 lightly==1.6.0 libauc==2.0.1
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/torch-contrastive train

test: $(STAMP)
	# --strict counts warnings only when they are printed: no --quiet here
	$(BIN)/mkdocs build --strict -d $(VENV)/site
	# both cores: one worker per core, each test file on one worker (a file's tests share module state)
	$(BIN)/python -m pytest -n 2 --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check src tests tools examples
	$(BIN)/mypy src

mutate: $(STAMP)
	$(BIN)/python tools/mutate.py

bench: $(STAMP)
	$(BIN)/torch-contrastive bench --quick

clean:
	rm -rf $(VENV) runs bench-results
