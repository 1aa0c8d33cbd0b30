# The user's commands. On first use they create .venv with the pinned dependencies.
# On a host where nothing can be installed (a GPU box with torch already there), pass PYTHON=python3:
# the harness then runs from this checkout with that interpreter and no virtual environment.
SUITE ?= smoke
ARGS ?=
VENV := .venv

# The optional packages a GPU host lacks, installed from wheels/ by scripts/offline-wheels (see docs/gpu.md).
OFFLINE_SITE := .wheels/site

ifdef PYTHON
# The user's own PYTHONPATH (their techniques and models) is kept, after this checkout.
RUN := PYTHONPATH=.:$(OFFLINE_SITE)$(if $(PYTHONPATH),:$(PYTHONPATH)) $(PYTHON)
DEPS :=
# The host's pytest may lack pytest-xdist: the tests run in one process.
TEST_PROCESSES :=
else
RUN := $(VENV)/bin/python
DEPS := $(VENV)/.installed
# pytest-xdist: a test process per core and one more, at most 4 (each, with the runs it starts, held up to about
# 2 GB): a fifth of the suite's time is tests waiting on processes they started (a run's timeout, a signal's
# reach), and a third process on two cores fills it. One test handed out at a time, as a process frees up: the
# slowest are collected first (tests/conftest.py), and xdist's default of handing each process a quarter of
# its share at once gave one process all of them.
TEST_PROCESSES := -n $(shell python3 -c 'import os; print(min(4, (os.cpu_count() or 1) + 1))') --maxschedchunk 1
endif

# make's variables are case-sensitive: `make bench suite=resnet` would run smoke without a word.
$(foreach v,suite model budget args card nproc hf,$(if $(filter command line,$(origin $(v))),\
  $(error $(v)=$($(v)): make variables are upper case here, e.g. $(shell echo $(v) | tr a-z A-Z)=$($(v)))))

.DEFAULT_GOAL := help
.PHONY: help bench gpu fit advise report overview compare predict validate list docs lint format test test-full faults perf

help: ## this list
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'
	@echo "  variables: SUITE=name (suites/NAME.toml, default smoke), HF=PATH (a config.json instead), JOB=FILE (an axolotl, LLaMA-Factory or torchtune YAML instead), ARGS='--force …', PYTHON=python3 (no venv)"

# The tools whose job files --job reads, installed for their schemas and shipped configs alone (the
# tests hold the readers to them): each pins a transformers or torchao this harness does not run.
DOORS = axolotl==0.19.0 llamafactory==0.9.5 torchtune==0.6.1

# Quiet, with its progress: pip's own output (about 280 lines) goes to .venv/install.log, shown only on failure.
$(VENV)/.installed: pyproject.toml
	@echo "first use: installing the pinned dependencies into $(VENV) (about 2 to 3 min; pip's log: $(VENV)/install.log)"
	@echo "  [1/3] creating $(VENV)" && python3 -m venv $(VENV)
	@echo "  [2/3] updating pip" && $(VENV)/bin/pip install --quiet --upgrade pip > $(VENV)/install.log 2>&1 \
		|| { tail -30 $(VENV)/install.log; exit 1; }
	@echo "  [3/3] torch, torchvision, transformers, pandas, matplotlib, scikit-learn, deepspeed and the extras" && \
		$(VENV)/bin/pip install -e '.[test,extras,data,cluster,sharding]' >> $(VENV)/install.log 2>&1 \
		|| { tail -30 $(VENV)/install.log; exit 1; }
	@echo "  and the config schemas of axolotl, LLaMA-Factory and torchtune, without their own pins" && \
		$(VENV)/bin/pip install --no-deps $(DOORS) >> $(VENV)/install.log 2>&1 \
		|| { tail -30 $(VENV)/install.log; exit 1; }
	@touch $@ && echo "  installed: $$(grep -c '' $(VENV)/install.log) lines of pip's log in $(VENV)/install.log"

bench: $(DEPS) ## run (or resume) SUITE, then write its table and plots (HF=config.json: that model's job instead)
	$(RUN) -m bench run $(if $(JOB),--job $(JOB),$(if $(HF),--hf $(HF),$(SUITE))) $(ARGS)

gpu: $(DEPS) ## on a CUDA host: every default suite, runs never measured there first (resumes; ETA), then CUDA tests
	@if [ -d wheels ]; then scripts/offline-wheels install "$(or $(PYTHON),$(VENV)/bin/python)"; fi
	$(RUN) -m bench campaign --device cuda $(ARGS)
	$(RUN) -m pytest -m cuda -p no:cacheprovider

predict: $(DEPS) ## predicted peak memory of SUITE (or HF=config.json) at GPU shapes, no GPU needed (CARD=rtx4090: the verdict on it; BUDGET=16GiB: what fits; NPROC=8: per rank)
	$(RUN) -m bench predict $(if $(JOB),--job $(JOB),$(if $(HF),--hf $(HF),$(SUITE))) $(if $(CARD),--card $(CARD)) $(if $(BUDGET),--budget $(BUDGET)) $(if $(RESERVE),--reserve $(RESERVE)) \
		$(if $(NPROC),--nproc $(NPROC)) $(ARGS)

fit: $(DEPS) ## the largest batch of each SUITE run that really fits BUDGET=16GiB (or, on a GPU, CARD=rtx4090), measured in probes, beside the predicted one
	$(RUN) -m bench fit $(SUITE) $(if $(CARD),--card $(CARD),--budget $(or $(BUDGET),$(error BUDGET=… or CARD=… is required, e.g. BUDGET=16GiB))) $(ARGS)

advise: $(DEPS) ## the cheapest plans that fit MODEL=bert-base (or a suite file) on CARD=rtx4090 or in BUDGET=8GiB; writes suites/advice-MODEL.toml
	$(RUN) -m bench advise $(or $(MODEL),$(error MODEL=… is required, e.g. MODEL=bert-base)) \
		$(if $(CARD),--card $(CARD),--budget $(or $(BUDGET),$(error CARD=… or BUDGET=… is required, e.g. CARD=rtx4090 or BUDGET=8GiB))) $(ARGS)

report: $(DEPS) ## rebuild results/SUITE/{table.csv,report.md,report.html,plots/} from stored records
	$(RUN) -m bench report $(SUITE)

overview: $(DEPS) ## one page over every suite in results/: what to use, per model; results/figures.md; results/README.md's fields
	$(RUN) -m bench overview

compare: $(DEPS) ## per-run changes from A to B (result folders), regressions flagged: make compare A=… B=…
	$(RUN) -m bench compare $(A) $(B) $(ARGS)

validate: $(DEPS) ## check every suite file
	$(RUN) -m bench validate

list: $(DEPS) ## models and techniques with their options
	$(RUN) -m bench list

docs: $(DEPS) ## the generated tables of docs/: techniques (from their classes), GPU records against predictions, a suite's keys
	$(RUN) -m bench list --docs docs/techniques.md --held docs/measuring.md --keys docs/suites.md \
		--predictions-schema docs/predictions.schema.json --advice-schema docs/advice.schema.json

lint: $(DEPS) ## ruff's rules and its formatting over bench/ and tests/ (pyproject.toml); run by make test
	@if $(RUN) -m ruff --version > /dev/null 2>&1; then $(RUN) -m ruff check bench tests \
		&& $(RUN) -m ruff format --check bench tests; \
	else echo "lint: skipped, no ruff for $(or $(PYTHON),$(VENV)/bin/python) (a host that cannot install it)"; fi

format: $(DEPS) ## rewrite bench/ and tests/ in ruff's format, lines at most 100 (what make lint checks)
	$(RUN) -m ruff format bench tests

test: $(DEPS) lint ## ruff, then the test suite (CPU; CUDA tests skip without a GPU)
	$(RUN) -m pytest $(TEST_PROCESSES)

test-full: $(DEPS) ## the tests that confirm figures end to end (measured advice, gloo ranks, full-size models): CI's second step
	$(RUN) -m pytest $(TEST_PROCESSES) -m full

faults: $(DEPS) ## the fault corpus alone: signals, stored data, disk, CLI values, resources, hostile text (in make test too)
	$(RUN) -m pytest $(TEST_PROCESSES) -m fault

perf: $(DEPS) ## the harness's step against a hand-written loop, and the run launchers side by side (not in make test)
	$(RUN) -m pytest tests/perf -m perf --benchmark-enable -s
