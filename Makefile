# Two commands do all set-up on a fresh machine:  `make demo` (the main job) and `make test` (the test suite).
# Everything runs offline: the embedded tiny model is built locally, nothing is downloaded from the Hub.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# `torch==2.13.0` takes this machine's local CPU wheel; a bare `torch` would pull a multi-GB CUDA build.
# GPU machines: `make install TORCH_SPEC=torch` (or install torch yourself first).
TORCH_SPEC ?= torch==2.13.0

export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export TOKENIZERS_PARALLELISM := false
export DS_BUILD_OPS := 0
# One torch thread unless you say otherwise: with 2 threads on a 2-core machine that also runs other work, each
# thread spins waiting for the other and the tiny recipes ran 10-100x slower (benchmarks/memory_scaling.py).
export OMP_NUM_THREADS ?= 1

.PHONY: install size test test-fast test-vllm test-integrations test-lmms-eval test-trackers demo experiment-perception experiment-dynamic-sampling experiment-generalization experiment-seeds bench lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev,deepspeed]"
	touch $@

test: install
	$(PY) -m ruff check .
	$(PY) .ci/lint_imports.py
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder

test-fast: install
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not slow"

demo: install
	$(PY) -m vision_grpo.demo

# Experiment 3 (docs/demo.md): GRPO against an SFT control at equal token-passes where perception limits the model;
# its section joins results/demo/report.md, its compute curve is results/demo/perception_curve.png.
experiment-perception: install
	$(PY) -m vision_grpo.demo --experiments perception

# Experiment 4 (docs/demo.md): GRPO with and without dynamic sampling from Experiment 3's warm start (its runs reused
# when finished), held-out accuracy against compute; its section joins results/demo/report.md.
experiment-dynamic-sampling: install
	$(PY) -m vision_grpo.demo --experiments dynamic

# Experiment 5 (docs/demo.md): Experiment 3's arms (its runs reused when finished) on held-out sets out of the
# training distribution; its section joins results/demo/report.md, its PNGs are results/demo/generalization_*.png.
experiment-generalization: install
	$(PY) -m vision_grpo.demo --experiments generalization

# Experiments 3 and 5 over three training seeds (docs/demo.md): 42 is the recipes' own (make experiment-perception's
# runs, reused when finished), 43 and 44 train their own; two lanes side by side, one core each; then the spread
# (each arm's mean and range, McNemar per seed), which joins results/demo/report.md.
SEEDED := -m vision_grpo.demo --experiments perception generalization --jobs 1
experiment-seeds: install
	( $(PY) $(SEEDED) && $(PY) $(SEEDED) --seed 44 ) & lane=$$!; \
	$(PY) $(SEEDED) --seed 43; other=$$?; wait $$lane && test $$other -eq 0
	$(PY) -m vision_grpo.demo.seeds --seeds 42 43 44

bench: install
	$(PY) benchmarks/run_all.py

# Real-vLLM tests (tests_vllm/): a CPU build of vLLM in its own venv, never mixed into .venv; see tests_vllm/make_env.sh
# for what that environment needs that a GPU install (`pip install -e ".[vllm]"`) does not.
VLLM_VENV ?= .venv-vllm

$(VLLM_VENV)/.installed: pyproject.toml tests_vllm/make_env.sh tests_vllm/patch_torchvision.py
	PYTHON=$(PYTHON) tests_vllm/make_env.sh $(VLLM_VENV)
	touch $@

# Two workers, a test file each (its module fixtures train and export once): each worker has its own caches.
test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest tests_vllm -p no:cacheprovider -n 2 --dist loadfile

# Tests against the field's tools outside TRL (tests_integrations/): lmms-eval scoring our held-out sets, and the
# SwanLab / Trackio trackers; their own venv, never mixed into .venv (tests_integrations/make_env.sh says why).
INTEGRATIONS_VENV ?= .venv-integrations
INTEGRATIONS := $(INTEGRATIONS_VENV)/bin/python -m pytest -p no:cacheprovider

$(INTEGRATIONS_VENV)/.installed: pyproject.toml tests_integrations/make_env.sh tests_vllm/patch_torchvision.py
	PYTHON=$(PYTHON) tests_integrations/make_env.sh $(INTEGRATIONS_VENV)
	touch $@

# Two workers; the tests of one model family share a worker (their module fixture trains once).
test-integrations: $(INTEGRATIONS_VENV)/.installed
	$(INTEGRATIONS) tests_integrations -n 2 --dist loadgroup

test-lmms-eval: $(INTEGRATIONS_VENV)/.installed
	$(INTEGRATIONS) tests_integrations/test_lmms_eval.py -n 2 --dist loadgroup

test-trackers: $(INTEGRATIONS_VENV)/.installed
	$(INTEGRATIONS) tests_integrations/test_trackers.py

# ruff, then the package's layers (import-linter, the contracts in pyproject.toml; see .ci/lint_imports.py).
lint: install
	$(PY) -m ruff check . && $(PY) -m ruff format --check . && $(PY) .ci/lint_imports.py

# The house's size: non-test Python lines by package (vision_grpo's sub-packages apart), then the tests'.
SIZED := vision_grpo data rewards recipes eval benchmarks
size:
	@find $(SIZED) -name '*.py' -print0 | xargs -0 wc -l | grep -v ' total$$' | awk '{ split($$2, p, "/"); \
	  key = (p[1] == "vision_grpo" && p[3] != "") ? p[1] "/" p[2] : p[1]; n[key] += $$1; t += $$1 } \
	  END { for (k in n) printf "%6d  %s\n", n[k], k; printf "%6d  non-test Python\n", t }' | sort -n
	@find tests tests_vllm tests_integrations -name '*.py' -print0 | xargs -0 cat | wc -l | xargs printf '%6d  tests\n'

clean:
	rm -rf runs results .pytest_cache .ruff_cache
