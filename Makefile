# Set-up is part of each target: a fresh clone needs only `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv demo test test-image test-image-pi5 clean

# llama-cpp-python compiles from source (about 15-20 min on 2 cores); pip caches the built wheel, so
# later installs take seconds. silero-vad goes in with --no-deps: its torch dependency is several GB and
# unused (we run its ONNX file with onnxruntime). So does pipecat-ai, for the Smart Turn v3.2 ONNX file it
# ships (appliance/eot.py; pinned: the file's SHA-256 is checked when it loads).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e '.[test]'
	$(BIN)/pip install --no-deps 'silero-vad>=5.1' 'pipecat-ai==1.14.0'
	touch $(STAMP)

venv: $(STAMP)

# The main job on the embedded defaults: replay the bundled question with a barge-in.
demo: $(STAMP)
	$(BIN)/appliance replay demo/barge-in.yaml --out out/demo --embedded

test: $(STAMP)
	$(BIN)/python -m pytest -q

# Slow (tens of minutes; run as root, whenever the image changes): build the qemu test image and boot it
# in qemu-system-aarch64, checking over SSH that the service is up and `appliance doctor` runs. Needs the
# Debian packages listed in docs/image.md.
IMAGE_VERSION := $(shell sed -nE 's/^version *= *"([^"]+)"/\1/p' pyproject.toml)
test-image:
	python3 tests/image_qemu_boot.py --check-tools   # qemu-system-aarch64, qemu-img...: before the build
	./build-image.sh --target qemu --no-models --check-tools
	mkdir -p out
	rm -f out/test-image-key out/test-image-key.pub
	ssh-keygen -q -t ed25519 -N '' -C test-image -f out/test-image-key
	export APPLIANCE_PASSWORD=$$(openssl rand -hex 12); \
	./build-image.sh --target qemu --no-models --ssh-key out/test-image-key.pub --password --no-compress \
	  && python3 tests/image_qemu_boot.py out/appliance-$(IMAGE_VERSION)-qemu.img --key out/test-image-key

# Slow (about an hour cold on 2 cores; run as root): the Raspberry Pi 5 image with Debian's kernel, built
# end to end from the Debian archive and PyPI alone (no Raspberry Pi archive), then its boot partition
# checked by tools/check-pi5-boot (QEMU cannot boot a Pi 5; hw-tests/README.md is the real first boot).
test-image-pi5:
	./build-image.sh --target pi5 --pi5-kernel debian --no-models --check-tools
	mkdir -p out
	rm -f out/test-image-key out/test-image-key.pub
	ssh-keygen -q -t ed25519 -N '' -C test-image -f out/test-image-key
	./build-image.sh --target pi5 --pi5-kernel debian --no-models --ssh-key out/test-image-key.pub --no-compress \
	  && python3 tools/check-pi5-boot out/appliance-$(IMAGE_VERSION)-debian-kernel.img \
	  && ls -ls --block-size=M out/appliance-$(IMAGE_VERSION)-debian-kernel.img

clean:
	rm -rf out .pytest_cache
