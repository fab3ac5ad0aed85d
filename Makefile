# torch-contrastive: every target sets itself up (.venv, CPU torch wheel first).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench mutate setup clean compile-check triton36

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

# Triton 3.6.0 (torch 2.11's CUDA wheels pin it) beside the newest: a tree put first on PYTHONPATH, with a NumPy
# below 2.3 (triton 3.6's interpreter converts one-element arrays with int(), which NumPy 2.3 refuses)
TRITON36 := $(VENV)/triton-3.6.0
CHECK := $(BIN)/python tools/compile_check.py

$(TRITON36): $(STAMP)
	rm -rf $@
	$(BIN)/pip install -q --no-deps --target $@ triton==3.6.0 'numpy<2.3'

# The interpreter tests of the kernels and the compile check's tests under triton 3.6.0
triton36: $(TRITON36)
	PYTHONPATH=$(TRITON36) $(BIN)/python -m pytest -n 2 --dist loadfile -W ignore::DeprecationWarning \
	  tests/engine/test_triton.py tests/engine/test_epilogue.py tests/engine/test_normalize_rows.py tests/engine/test_gemm.py \
	  tests/test_compile_check.py

# Every recorded kernel in each operand class, every config, sm_80 and sm_90, under both Triton versions (no GPU):
# the full table to docs/compile_table.md, its summary into docs/gpu.md; the last step exits 1 if a row fails.
compile-check: $(TRITON36)
	$(CHECK) check tools/triton_variants.json --sample --shard 0/2 --json $(VENV)/cc-new-0.json & \
	  $(CHECK) check tools/triton_variants.json --sample --shard 1/2 --json $(VENV)/cc-new-1.json; wait
	PYTHONPATH=$(TRITON36) $(CHECK) check tools/triton_variants.json --sample --shard 0/2 --json $(VENV)/cc-36-0.json & \
	  PYTHONPATH=$(TRITON36) $(CHECK) check tools/triton_variants.json --sample --shard 1/2 --json $(VENV)/cc-36-1.json; wait
	$(CHECK) table $(VENV)/cc-new-0.json $(VENV)/cc-new-1.json $(VENV)/cc-36-0.json $(VENV)/cc-36-1.json \
	  --out docs/compile_table.md --summary docs/gpu.md

mutate: $(STAMP)
	$(BIN)/python tools/mutate.py

bench: $(STAMP)
	$(BIN)/torch-contrastive bench --quick

clean:
	rm -rf $(VENV) runs bench-results
