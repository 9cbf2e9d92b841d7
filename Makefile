# Two entry points (see README): `make app` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup app test test-fast test-kernels lint docs browser fashion-mnist bench bench-app clean

setup: $(STAMP) fashion-mnist

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

app: $(STAMP) fashion-mnist
	$(BIN)/oodviz app --headless --host 127.0.0.1

# The browser tests drive Debian's Chromium; install it where we may (root with apt), else they skip.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium not found and not root: the browser tests will be skipped (sudo apt-get install chromium)"; fi; }

# The Fashion-MNIST preset reads Debian's dataset-fashion-mnist (the real files, offline); install it where
# we may (root with apt), else say where the preset gets its data from.
fashion-mnist:
	@[ -f /usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz ] || [ -f data/FashionMNIST/raw/t10k-labels-idx1-ubyte ] || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null; \
	  else echo "Fashion-MNIST not installed and not root: the fashion-mnist preset downloads it on first use when downloads are allowed (or: sudo apt-get install dataset-fashion-mnist); its tests are skipped"; fi; }

# Two pytest-xdist workers; tests sharing an expensive fixture (a finished run, a server) stay on one worker
# (tests/conftest.py groups them). TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
# compileall: the package's bytecode written once, for the hundreds of processes the tests start (where
# PYTHONDONTWRITEBYTECODE is set, each would compile every module it imports again: 0.1-0.3 s apiece).
test: $(STAMP) browser fashion-mnist
	$(BIN)/python -m compileall -q oodviz
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=15

# Everything but the tests marked browser (Chromium), process (a real process: an oodviz command, a server, a fresh
# interpreter, torchrun; or the default run that `oodviz run` makes) and cuda: under 2 minutes on 2 cores, for the
# edit-test loop. `make test` stays the whole suite (CI's).
FAST := not browser and not process and not cuda
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "$(FAST)" --durations=10

# The tests marked `kernels` (float results that other kernels could change) again, with other kernels: one thread,
# AVX2 (ATen's, oneDNN's and MKL's own variables) and another batch size; then oneDNN off (tests/kernel_variant) and
# another. A comparison that holds with this CPU's kernels only fails here too, not first on another CPU
# (tests/kernels.py; CI runs it after `make test`).
KERNEL_VARIANTS := \
	"OMP_NUM_THREADS=1 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 OODVIZ_TEST_BATCH_SIZE=37" \
	"OMP_NUM_THREADS=2 OODVIZ_TEST_ONEDNN=off PYTHONPATH=tests/kernel_variant OODVIZ_TEST_BATCH_SIZE=100"
test-kernels: $(STAMP) fashion-mnist
	@for variant in $(KERNEL_VARIANTS); do \
	  echo "== make test-kernels: $$variant"; \
	  env $$variant $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m kernels -q || exit 1; \
	done

# The import contract too (pyproject's [tool.importlinter]): the layers in data-flow order, no import circle; and the
# documentation site built strictly (make docs: no broken link, no reference mkdocstrings cannot resolve).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(MAKE) --no-print-directory docs

# The documentation site, offline (Material without Google fonts, KaTeX from the package), into site/; --strict:
# a broken link or a reference mkdocstrings cannot resolve fails the build (tests/test_docs.py builds it too).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(BIN)/python bench/detectors.py

# The app in Chromium: cold load, tab switch, slider step, bytes per chart and of the live panel; then the same
# clicks on the smallest Streamlit page that draws a chart and a table: the floor under them (bench/RESULTS.md).
bench-app: $(STAMP) browser
	$(BIN)/python bench/app_bench.py
	$(BIN)/python bench/streamlit_floor.py

clean:
	rm -rf $(VENV) .pytest_cache site
