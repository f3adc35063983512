# Every target builds .venv from nothing when it is missing; reruns are cheap (idempotent).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Every Ray cluster the targets start (the tests', make soak's, the benchmarks', the examples')
# runs on loopback, 127.0.0.1: Ray reads this when it is imported; without it, on Linux, a local
# cluster is announced on the machine's interface address (docs/ray.md). tests/conftest.py sets
# it too, for a pytest run outside make.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0

.PHONY: demo test lint typecheck unit wide soak bench docs examples-smoke test-nightly test-mjlab test-playground test-genesis clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: pip takes the CPU wheel from this machine's disk instead of a CUDA build
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test,bench,docs,ray,mujoco]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/envsync demo

lint: $(STAMP)
	$(BIN)/ruff check envsync tests examples benchmarks
	$(BIN)/ruff format --check envsync tests examples benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

# The unit tests: every test under tests/ not marked `wide`, and envsync's doctests, in one
# pytest run (about 8 minutes on 2 cores). Workers fork unless a test is about spawn; the tests
# on the Ray cluster run last, on one two-node cluster for the whole run (tests/conftest.py).
# Of the model-based test it runs the covering subset of cells (test_model.py's COVERING:
# each collector kind, env kind, apply mode and operation); of the matrix, every local cell and
# the Ray cells of a Collector; of the push soak, the short fork run.
unit: $(STAMP)
	$(BIN)/python -m pytest -q -rfE --durations=25 -m "not wide"

# What CI runs first, and what a change must pass: lint (ruff), typecheck (mypy), unit, docs.
test: lint typecheck unit docs

# The wider set, CI's second step (.ci/run: make test, then make wide): the tests marked `wide`,
# in one pytest run: every other model-based cell once at its fixed seed (with make test's
# subset: every cell once), the Ray cells of the matrix for MultiSync/MultiAsync collectors, the
# load runs at a quarter of make soak's sizes, the short push soak with spawned workers, the slow
# Ray tests (a stalled actor; a program that never closes its sender; the kinds of a killed actor
# and of a batched Ray worker beyond the one make test keeps; the Ray twins of tests make test runs
# locally: sync_stats over two nodes, a checkpoint of every worker, the ledger, a bandit per worker;
# reset and truncate mode and a workers= push with reinit over Ray, which make test's model-based and
# matrix cells over Ray keep),
# a spawned MultiSyncCollector's end-to-end push (make test keeps a spawned Collector and
# MultiAsyncCollector), and the slowest benchmark smoke runs (bench_ray, bench_push_instructions,
# bench_switch_latency, bench_curriculum_instructions, bench_worlds).
wide: $(STAMP)
	$(BIN)/python -m pytest -q -rfE --durations=25 -m wide

# Long runs, by hand: every model-based cell once at its fixed seed, then the model-based test
# with fresh seeds for ENVSYNC_MODEL_SECONDS (default 20 minutes; set ENVSYNC_MODEL_SEED to
# repeat a run), then the push soak tests with the load runs at full size (-s shows the model's
# summary); then, on one Ray cluster, every Ray cell of the matrix and the model-based test over
# Ray on every Ray cell for ENVSYNC_MODEL_RAY_SECONDS (default 20 minutes).
soak: $(STAMP)
	ENVSYNC_MODEL_SECONDS=$${ENVSYNC_MODEL_SECONDS:-1200} ENVSYNC_SOAK_FULL=1 $(BIN)/python -m pytest -q -s tests/test_model.py::test_model tests/test_model.py::test_model_soak tests/test_e2e_soak.py
	ENVSYNC_MODEL_RAY_SECONDS=$${ENVSYNC_MODEL_RAY_SECONDS:-1200} $(BIN)/python -m pytest -q -s tests/test_matrix.py::test_ray_cell tests/test_model_ray.py::test_model_ray_soak

# The local cells of the matrix and the model-based test on every local cell, on torchrl-nightly
# and tensordict-nightly, in a venv of their own on the pinned torch (not part of `make test`);
# stops first if the nightlies need another torch. The run must also exit cleanly (an abort at
# interpreter exit after a passing suite fails it).
NIGHTLY := .venv-nightly
test-nightly:
	test -x $(NIGHTLY)/bin/python || $(PY) -m venv $(NIGHTLY)
	$(NIGHTLY)/bin/python -m pip install --quiet --upgrade pip
	$(NIGHTLY)/bin/python -m pip install --quiet torch==2.13.0
	$(NIGHTLY)/bin/python -m pip install --dry-run --quiet torch==2.13.0 torchrl-nightly tensordict-nightly \
		|| { echo "torchrl-nightly/tensordict-nightly need a torch other than 2.13.0: stopping"; exit 1; }
	$(NIGHTLY)/bin/python -m pip install --quiet torch==2.13.0 torchrl-nightly tensordict-nightly
	# envsync without its torchrl/tensordict pins (the nightlies stand in for them), then its other needs
	$(NIGHTLY)/bin/python -m pip install --quiet --no-deps -e .
	$(NIGHTLY)/bin/python -m pip install --quiet cloudpickle gymnasium numpy tqdm pytest pytest-timeout hypothesis psutil
	$(NIGHTLY)/bin/python -m pytest -q tests/test_matrix.py tests/test_model.py tests/test_receiver.py tests/test_policy_version.py -k "not ray and not soak"

# A simulator's venv of its own, .venv-<extra> with envsync[<extra>] (each simulator pins what the main
# venv cannot hold): torch first, pinned, and named again with the extra, so that pip keeps the CPU wheel;
# PINS_<extra> names what must be pinned beside it.
.venv-%/.installed: pyproject.toml
	test -x .venv-$*/bin/python || $(PY) -m venv .venv-$*
	.venv-$*/bin/python -m pip install --quiet --upgrade pip
	.venv-$*/bin/python -m pip install --quiet torch==2.13.0
	.venv-$*/bin/python -m pip install --quiet torch==2.13.0 $(PINS_$*) -e ".[$*]" pytest pytest-timeout
	touch .venv-$*/.installed

# Per-world physics in mjlab (MuJoCo Warp) on Warp's CPU device: mjlab pins mujoco~=3.11, the main
# venv's mujoco extra is 4.0 (gymnasium's HalfCheetah-v5). torchvision is pinned: mjlab -> rsl-rl-lib ->
# torchvision, whose newest release pins torch 2.14 and would replace the CPU torch with a CUDA build.
# About 3 minutes of tests, plus about a minute of Warp kernel compilation the first time on a machine
# (cached in ~/.cache/warp).
MJLAB := .venv-mjlab
PINS_mjlab := torchvision==0.28.0
test-mjlab: $(MJLAB)/.installed
	$(MJLAB)/bin/python -m pytest -q -rfE --durations=10 tests/test_mjlab.py

# Per-world physics in MuJoCo Playground (MJX, JAX on the CPU): playground brings jax, mujoco-mjx and
# warp-lang, which the main venv does not need. About 4 minutes of tests on 2 cores (5.6 from an empty venv).
PLAYGROUND := .venv-playground
test-playground: $(PLAYGROUND)/.installed
	$(PLAYGROUND)/bin/python -m pytest -q -rfE --durations=10 tests/test_playground.py

# Per-world physics in Genesis (its CPU backend): genesis-world brings quadrants, vtk, opencv and more
# (4.2 GB with torch, ~3 minutes to install here). Not in .ci/run: see docs/domain_randomization.md.
GENESIS := .venv-genesis
test-genesis: $(GENESIS)/.installed
	$(GENESIS)/bin/python -m pytest -q -rfE --durations=10 tests/test_genesis.py

docs: $(STAMP)
	test -x $(BIN)/mkdocs || $(BIN)/python -m pip install --quiet -e ".[docs]"
	$(BIN)/mkdocs build --strict -d build/site

examples-smoke: $(STAMP)
	$(BIN)/python -m pytest -q tests/test_examples.py

bench: $(STAMP)
	$(BIN)/envsync bench

clean:
	rm -rf $(VENV) $(NIGHTLY) $(MJLAB) $(PLAYGROUND) $(GENESIS) build *.egg-info
