# The two commands a user needs: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo bench fuzz matrix dist docs clean

# Re-install only when the package metadata changes.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The docs extra (MkDocs, its theme, mkdocstrings), installed into .venv once.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,docs]'
	touch $(DOCS_STAMP)

# The documentation site in site/, strict: a warning (a broken link, a docstring mkdocstrings
# cannot read, an unknown generated part) fails the build. tests/test_docs.py runs its examples.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m mkdocs build --strict --site-dir site

# -rs: every skip says why. Skips: the fuzz's grappler property where live grappler cannot
# answer (bfloat16 without AVX512F); a test that is only a comparison with grappler on a
# TensorFlow release that builds its graph otherwise; the drawing tests without Graphviz's
# dot, the browser test without Chromium, the unprivileged-user test without root and
# setpriv; the float8 tests before TensorFlow 2.18; a tool's smoke run (tests/test_tools.py:
# every tools/*.py --smoke) that cannot run here, with its reason. The summary counts the comparisons.
# -n 2 --dist loadfile: two pytest-xdist workers (CI's two cores), each test file in one of them,
# so a file's module fixtures (trained models, exported SavedModels) are built once.
test: install
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m pytest -q -rs -n 2 --dist loadfile tests

demo: install
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) tools/demo.py

# Pass time vs grappler, bfloat16 vs float32 op kernels, model speed-ups vs float32 (writes BENCHMARKS.md), then
# calibration's cost on ResNet50 and BERT-base, then serving converted SavedModels, then serving a model
# trained under mixed_float16, retargeted, then LLM decode loops, then keras_hub backbones served (each writes BENCHMARKS.md); all run, and a failing status is kept. Run on a quiet machine.
bench: install
	status=0; \
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) tools/bench_pass.py || status=$$?; \
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) tools/bench_ops.py || status=$$?; \
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) tools/bench.py || status=$$?; \
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) tools/bench_calibration.py || status=$$?; \
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) tools/bench_serving.py || status=$$?; \
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) tools/bench_retarget.py || status=$$?; \
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) tools/bench_decode.py || status=$$?; \
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) tools/bench_hub_serving.py || status=$$?; \
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) tools/bench_memory.py --dir $${AMP_BIG_DIR:-/tmp} || status=$$?; \
	exit $$status

# A long random search of the pass (tests/test_fuzz.py; make test runs 50 derandomized examples per target).
fuzz: install
	AMP_FUZZ_EXAMPLES=2000 TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m pytest -q tests/test_fuzz.py -k random_graphs

# The whole suite once per supported TensorFlow release, each in a fresh venv under .matrix/ (long).
matrix: install
	$(PY) tools/matrix.py

# The sdist and the wheel in dist/, built as a release is (python -m build, in an isolated
# environment) and checked as PyPI checks them (twine check). An old *.egg-info would add
# the files it lists to the sdist: each build starts without one.
dist: install
	$(PY) -m pip install -q build twine
	rm -rf dist build *.egg-info
	$(PY) -m build --outdir dist .
	$(PY) -m twine check --strict dist/*

clean:
	rm -rf $(VENV) .matrix *.egg-info .pytest_cache build dist site
