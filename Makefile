# The two set-up commands of the README: `make run` and `make test`. Each creates .venv when missing,
# installs the project (torch==2.13.0 first: the CPU build on disk; a bare `torch` would pull a
# multi-GB CUDA build), and starts NATS (JetStream) and Redis on 127.0.0.1 where none answers.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test lint bench install brokers browser models compose-check compose-smoke clean

# tests/plugins/t2i_example is a user ModelFn package, installed the way users ship theirs.
$(STAMP): pyproject.toml tests/plugins/t2i_example/pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[executor,local,test,bench]'
	$(BIN)/python -m pip install --quiet --no-deps -e tests/plugins/t2i_example
	@touch $@

install: $(STAMP)

brokers: install
	$(BIN)/python -m libs.launcher.brokers

models: install
	$(BIN)/python -m libs.models.build --out models --preset tiny

run: install
	$(BIN)/python -m libs.launcher

# Headless Chromium for the web console's browser test (tests/e2e/test_console_browser.py), from
# Debian's packages: playwright drives /usr/bin/chromium and downloads no browser. Where it cannot be
# installed (not Debian, not root) the test is skipped and says why.
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  (apt-get update -qq && apt-get install -y -qq chromium) || \
	  echo "make browser: could not install chromium (run as root on Debian/Ubuntu); the console's browser test will be skipped"

test: install brokers browser
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check libs services tests bench
	$(BIN)/ruff format --check libs services tests bench
	$(BIN)/lint-imports

bench: install brokers
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/fairness.py
	$(BIN)/python bench/prefix.py

# The compose file as `up` reads it, with one executor and with four (T2I_EXECUTORS, like --scale).
compose-check: install
	$(BIN)/docker-compose -f deploy/compose.yaml config --quiet
	T2I_EXECUTORS=4 $(BIN)/docker-compose -f deploy/compose.yaml config --quiet
	$(BIN)/docker-compose -f deploy/compose.yaml -f deploy/compose.local.yaml config --quiet

# `docker compose up` of deploy/compose.yaml for real, then `down -v` (bench/compose_smoke.py; minutes):
# on a machine without GPUs or a registry, with deploy/compose.local.yaml and the local images of
# deploy/local/build-images.sh (root: debootstrap). SMOKE_ARGS=--gpu on a GPU box. The Docker daemon:
# one that answers, else a private one deploy/local/dockerd.sh starts (installing docker.io if needed).
compose-smoke: install
	DOCKER_HOST="$$(deploy/local/dockerd.sh)" $(BIN)/python bench/compose_smoke.py $(SMOKE_ARGS)

clean:
	rm -rf $(VENV) models var out
