# Set-up is part of each target: a fresh clone needs only `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv demo test clean

# llama-cpp-python compiles from source (about 15-20 min on 2 cores); pip caches the built wheel, so
# later installs take seconds. silero-vad goes in with --no-deps: its torch dependency is several GB and
# unused (we run its ONNX file with onnxruntime).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e '.[test]'
	$(BIN)/pip install --no-deps 'silero-vad>=5.1'
	touch $(STAMP)

venv: $(STAMP)

# The main job on the embedded defaults: replay the bundled question with a barge-in.
demo: $(STAMP)
	$(BIN)/appliance replay demo/barge-in.yaml --out out/demo --embedded

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf out .pytest_cache
