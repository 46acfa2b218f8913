# The two commands of the quickstart. Each creates .venv (Python 3.11) when missing.
PYTHON ?= python3.11
VENV   := .venv
# .ci/run's Python 3.12 lane sets EXTRAS=test: no Reverb/TensorFlow wheels there (in-process
# replay), and no torch (parity tests against transformers' torch models skip).
EXTRAS ?= test,reverb,parity
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: demo test clean

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[$(EXTRAS)]'
	@rm -f $(VENV)/.installed-* && touch $@

## make demo: the embedded default demo on CPU (ARGS='train.steps=40 ...' to override)
demo: $(STAMP)
	$(VENV)/bin/jaxreplay train configs/demo.yaml $(ARGS)

## make test: the whole suite, slow end-to-end runs included (PYTEST_ARGS='-m "not slow"' to skip them)
test: $(STAMP)
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
