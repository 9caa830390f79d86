# Two entry points, each doing all set-up on a fresh machine:
#   make demo   create .venv if needed, install, run the embedded default end to end
#   make test   the same set-up, then the whole test suite
# Optional: make bench-model builds the bench policy and its drafter into a cache folder outside the
# checkout (${TLT_CACHE:-${XDG_CACHE_HOME:-~/.cache}/tlt}/bench), reused while its recipe is unchanged.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tlt-installed

.PHONY: demo test install bench bench-model clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Pinned first and alone: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tlt demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/tlt bench forward

bench-model: $(STAMP)
	PYTHONUNBUFFERED=1 $(PY) -m tlt.bench_model

clean:
	rm -rf $(VENV) runs .pytest_cache
