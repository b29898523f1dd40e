# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv on first use (CPU torch 2.13 wheel unless TORCH_SPEC says otherwise).

VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test lint clean prometheus

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/numwatch demo

# Debian's prometheus (server and promtool) for tests/test_grafana_e2e.py and the promtool checks
# of tests/test_prometheus.py: installed when missing and apt-get can run (root); otherwise those
# tests skip and say why.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends prometheus; } >/dev/null 2>&1 \
	      || echo "note: apt-get could not install prometheus; its tests will skip"; \
	  else echo "note: prometheus is not installed (needs root and apt-get); its tests will skip"; \
	  fi; }

test: $(VENV)/.installed prometheus
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) numwatch-runs .pytest_cache
