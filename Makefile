# The two commands of the quickstart: `make demo` and `make test`. Each creates its lane's venv
# when missing, installs jaxreplay into it with that lane's constraints, and runs.
#
# LANE picks the dependency tier (docs/install.md):
#   default    Python >= 3.12, current jax/flax/orbax, in-process replay   .venv
#   py313      the same constraints on Python 3.13                          .venv-py313
#   gpu-image  jax 0.11.2 and the flax/optax/orbax that run with it (3.12)  .venv-gpu-image
#   reverb     Python 3.11, dm-reverb 0.14.0 + TensorFlow 2.15 + jax 0.4.34  .venv-reverb
#   tpu        the default tier plus libtpu (the tpu extra): TPU compiles on a CPU host  .venv-tpu
LANE ?= default

# The lane's Python, the first that runs of: pythonX.Y or python3 on PATH, pyenv's installed versions
# (its shims run only the versions selected, so its versions folder is read too), and uv's managed
# Pythons (`uv python find`, where uv is on PATH). PYTHON=/path/to/python skips the search.
# $(1): the Python versions the lane takes, the preferred first.
find_python = $(shell for v in $(1); do \
  for p in python$$v python3 $$(ls -d "$${PYENV_ROOT:-$$HOME/.pyenv}"/versions/$$v.*/bin/python$$v 2>/dev/null | sort -rV) \
      $$(uv python find --system $$v 2>/dev/null); do \
    "$$p" -c 'import sys; sys.exit(sys.version_info[:2] != tuple(map(int, sys.argv[1].split("."))))' $$v 2>/dev/null \
      && command -v "$$p" && exit; \
  done; done)

ifeq ($(LANE),default)
  PYTHONS := 3.12 3.13
  VENV ?= .venv
  EXTRAS ?= test
  CONSTRAINTS := constraints/default.txt
else ifeq ($(LANE),py313)
  PYTHONS := 3.13
  VENV ?= .venv-py313
  EXTRAS ?= test
  CONSTRAINTS := constraints/default.txt
else ifeq ($(LANE),gpu-image)
  PYTHONS := 3.12
  VENV ?= .venv-gpu-image
  EXTRAS ?= test
  CONSTRAINTS := constraints/gpu-image.txt
else ifeq ($(LANE),tpu)
  PYTHONS := 3.12 3.13
  VENV ?= .venv-tpu
  EXTRAS ?= test,tpu
  CONSTRAINTS := constraints/default.txt
else ifeq ($(LANE),reverb)
  PYTHONS := 3.11
  VENV ?= .venv-reverb
  EXTRAS ?= test,reverb,parity
  CONSTRAINTS := constraints/reverb-py311.txt
else
  $(error LANE=$(LANE): use default, py313, gpu-image, tpu or reverb)
endif
PYTHON ?= $(call find_python,$(PYTHONS))
# Where none is found: what to install, in two lines on stderr.
space := $(subst ,, )
WANTED := $(firstword $(PYTHONS))
NO_PYTHON = echo "jaxreplay: error: no Python $(subst $(space), or ,$(PYTHONS)) for LANE=$(LANE) on PATH, in pyenv's versions or uv's" >&2; \
  echo "  install one (pyenv install $(WANTED); uv python install $(WANTED); or python$(WANTED)-venv from the deadsnakes PPA) or set PYTHON=/path/to/python$(WANTED)" >&2

# uv resolves and installs the pinned set faster than pip (the Reverb lane's fresh venv, bytecode
# compiled by both: 101 s against pip's 167 s). uv does not read pip's configuration, so the wheel folders pip is told
# of (PIP_FIND_LINKS or `pip config`; where a machine keeps its CPU torch wheel) are handed to it.
INSTALLER ?= uv
PIP_FIND_LINKS ?= $(shell $(or $(PYTHON),python3) -m pip config get global.find-links 2>/dev/null)
INSTALL_uv = $(VENV)/bin/python -m uv pip install --python $(VENV)/bin/python $(addprefix --find-links ,$(PIP_FIND_LINKS))
INSTALL_pip = $(VENV)/bin/python -m pip install

# Python writes each module's bytecode when it first imports it, even where the environment says not to
# (PYTHONDONTWRITEBYTECODE, set on this project's machines): otherwise every process compiles jax, flax,
# orbax and TensorFlow from source again (24.6 s of CPU to import them with reverb, 8.6 s from bytecode).
# Lazily, not at install: compiling every venv's whole site-packages cost CI 305 s. Into the venv, so the
# checkout stays as cloned and `make clean` takes it too.
unexport PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX ?= $(abspath $(VENV))/pycache

STAMP := $(VENV)/.installed-$(shell (cat pyproject.toml $(CONSTRAINTS); echo '$(EXTRAS)') | cksum | cut -d' ' -f1)

.PHONY: venv demo test clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -n "$(PYTHON)" || { $(NO_PYTHON); exit 2; }
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip $(if $(filter uv,$(INSTALLER)),uv)
	$(INSTALL_$(INSTALLER)) --quiet -c $(CONSTRAINTS) -e '.[$(EXTRAS)]'
	@rm -f $(VENV)/.installed-* && touch $@

## make venv: the lane's venv, installed, and nothing run
venv: $(STAMP)

## make demo: the embedded default demo on CPU (ARGS='train.steps=40 ...' to override)
demo: $(STAMP)
	$(VENV)/bin/jaxreplay train configs/demo.yaml $(ARGS)

## make test: the lane's whole suite, slow end-to-end runs included (PYTEST_ARGS='-m "not slow"' to skip them),
## on TEST_WORKERS pytest-xdist workers, each taking whole files (a file's compiled programs and module fixtures
## are built once), the files with the most end-to-end runs first (tests/conftest.py)
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -rs $(PYTEST_ARGS)

## make venv-skypilot: SkyPilot alone in .venv-skypilot (Python >= 3.12), for `sky jobs launch launch/skypilot.yaml`
## and the test that validates that file (tests/test_pod_recipe.py); never in a lane's venv, whose pins it would move
SKYPILOT ?= skypilot==0.14.1
SKYPILOT_PYTHON ?= $(call find_python,3.12 3.13)
.venv-skypilot/.installed-$(SKYPILOT):
	@test -n "$(SKYPILOT_PYTHON)" || { echo "jaxreplay: error: no Python 3.12 or 3.13 for .venv-skypilot on PATH, in pyenv's versions or uv's; set SKYPILOT_PYTHON=/path/to/python3.12" >&2; exit 2; }
	@test -x .venv-skypilot/bin/python || $(SKYPILOT_PYTHON) -m venv .venv-skypilot
	.venv-skypilot/bin/python -m pip install --quiet --upgrade pip uv
	.venv-skypilot/bin/python -m uv pip install --python .venv-skypilot/bin/python --quiet '$(SKYPILOT)' pyyaml
	@rm -f .venv-skypilot/.installed-* && touch '$@'
.PHONY: venv-skypilot
venv-skypilot: .venv-skypilot/.installed-$(SKYPILOT)

## make venv-sidecar: the Reverb sidecar's environment in .venv-sidecar (Python 3.11: dm-reverb 0.14.0, TensorFlow
## 2.15 CPU, numpy < 2, PyYAML; no JAX). `replay.backend=reverb` on the default tier runs Reverb in it, beside the
## trainer (jaxreplay/replay/sidecar.py); the sidecar imports the trainer's own jaxreplay modules, so none is installed
SIDECAR_PYTHON ?= $(call find_python,3.11)
SIDECAR_PINS := constraints/reverb-py311.txt
.venv-sidecar/.installed-$(shell cat $(SIDECAR_PINS) | cksum | cut -d' ' -f1):
	@test -n "$(SIDECAR_PYTHON)" || { echo "jaxreplay: error: no Python 3.11 for .venv-sidecar on PATH, in pyenv's versions or uv's; install one (uv python install 3.11) or set SIDECAR_PYTHON=/path/to/python3.11" >&2; exit 2; }
	@test -x .venv-sidecar/bin/python || $(SIDECAR_PYTHON) -m venv .venv-sidecar
	.venv-sidecar/bin/python -m pip install --quiet --upgrade pip uv
	.venv-sidecar/bin/python -m uv pip install --python .venv-sidecar/bin/python $(addprefix --find-links ,$(PIP_FIND_LINKS)) --quiet -c $(SIDECAR_PINS) dm-reverb tensorflow-cpu pyyaml
	@rm -f .venv-sidecar/.installed-* && touch '$@'
.PHONY: venv-sidecar
venv-sidecar: .venv-sidecar/.installed-$(shell cat $(SIDECAR_PINS) | cksum | cut -d' ' -f1)

clean:
	rm -rf .venv .venv-* runs .pytest_cache .jax-cache
