# Two commands for a fresh machine:
#   make demo   runs the main example (examples/train.py, Hydra; outputs/ holds its runs),
#               installing only what it needs
#   make test   runs the test suite
# Each creates its own virtual environment (.venv, Python 3.11 / newest JAX there) and installs
# what it needs. `make test312` runs the suite under Python 3.12 and JAX 0.12 (.venv312).
# `make test-oracles` runs the random-program oracles with their full budget, exploring.

PYTHON ?= python3
# pyenv installs put python3.12 outside PATH on some machines; fall back to those.
PYTHON312 ?= $(shell command -v python3.12 >/dev/null 2>&1 && python3.12 --version >/dev/null 2>&1 && echo python3.12 || ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -n 1)

.PHONY: demo test test-oracles test-fast test312 mutations bench lint docs clean golden golden-record

.venv/.installed: pyproject.toml
	$(PYTHON) -m venv .venv
	.venv/bin/pip install -q --upgrade pip
	.venv/bin/pip install -q -e '.[dev]'
	touch $@

.venv312/.installed: pyproject.toml
	$(PYTHON312) -m venv .venv312
	.venv312/bin/pip install -q --upgrade pip
	.venv312/bin/pip install -q -e '.[dev]'
	touch $@

# The demo installs what the examples need alone (the package, and the `demo` extra:
# matplotlib for the plot command, optax), not the test and docs tools of `.[dev]`; an
# up-to-date test install (.venv/.installed, a superset) is used as it is.
.venv/.demo-installed: pyproject.toml
	test -x .venv/bin/python || $(PYTHON) -m venv .venv
	test .venv/.installed -nt pyproject.toml || .venv/bin/pip install -q -e '.[demo]'
	touch $@

demo: .venv/.demo-installed
	.venv/bin/python examples/train.py

# The random-program oracles (their few long tests shared out one by one in their own run).
ORACLES = tests/test_oracle.py tests/test_tap_oracle.py
# Two workers (pytest-xdist), each taking a whole test file at a time (so a file's
# module-scoped fixtures, such as its Hydra runs, are made once). `make test` runs the
# oracles' share among the other files, in the same two workers: a second run of pytest
# cost its own start and end (17 s collecting, 5 s ending). (Once, when one process ran the
# whole suite and the oracles' full budget, XLA's compiler crashed late in it, jax 0.10.2: a
# worker now compiles about half the suite and a sixteenth of that budget.)
WORKERS = -n 2 --dist loadfile
ORACLE_WORKERS = -n 2 --dist load
# The slowest tests of each run, so that the suite's time stays where it is worth spending.
DURATIONS = --durations=15
# The oracles' budgets (tests/test_oracle.py `budget`): `make test` replays the same programs
# every run (derandomized), a share of each test's full budget; `make test-oracles` spends
# the full budget on new programs each run, keeping the failing ones in .hypothesis/ (replayed
# first next time). `make test ORACLE_SHARE=1` replays the full derandomized budget. The
# mutation check replays a quarter of it, as it did when its table was first measured.
ORACLE_SHARE ?= 0.0625
ORACLES_SHARED = EQX_LOGS_ORACLE_SHARE=$(ORACLE_SHARE) EQX_LOGS_ORACLE_EXPLORE=0
# The suite compiles some ten thousand small programs and runs most of them once: it waits
# mostly for XLA's CPU compiler (measured with jax.monitoring on a whole run: 5,500 programs
# compiled in the tests' own processes, 440 s of the 1,230 s the tests took). `make test`
# and `make test312` tell it to compile quickly: LLVM at its lowest optimization level and
# without its expensive passes, and (jax 0.10) XLA's elemental emitters instead of its fusion
# emitters. Measured side by side (interleaved, two rounds), test_reductions.py with
# test_masking.py: 0.90x the wall time at -O0 (0.99x at -O1). -O0 does not fuse a multiply and
# an add into one instruction, so a float result can differ in its last bit from a user's
# default compile: the docs' pages, whose printed numbers must be what a user sees, run at
# the user's level (`helpers.user_env`), and a test comparing two compiled programs bit for
# bit compiles them at XLA's default level (`helpers.at_default_level`). `make test-oracles`
# runs at XLA's defaults, and `make test TEST_XLA_FLAGS=` runs the whole suite at them.
TEST_XLA_FLAGS ?= --xla_cpu_use_fusion_emitters=false --xla_llvm_disable_expensive_passes=true \
	--xla_backend_optimization_level=0
TEST_ENV = XLA_FLAGS="$(strip $(TEST_XLA_FLAGS) $(XLA_FLAGS))"
# JAX 0.12's XLA has no other emitters (an unknown flag aborts it).
TEST312_XLA_FLAGS ?= --xla_llvm_disable_expensive_passes=true --xla_backend_optimization_level=0
TEST312_ENV = XLA_FLAGS="$(strip $(TEST312_XLA_FLAGS) $(XLA_FLAGS))"
ORACLES_FULL = EQX_LOGS_ORACLE_SHARE=1 EQX_LOGS_ORACLE_EXPLORE=1

test: .venv/.installed
	$(TEST_ENV) $(ORACLES_SHARED) .venv/bin/python -m pytest -q $(DURATIONS) $(WORKERS)

# The exploring run draws its programs from a seed fixed by the code it tests (eqx_logs/ and
# tests/ as committed): a commit always meets the same programs, so a CI run can be replayed
# (`make test-oracles`) and a change to either draws new ones; `ORACLE_SEED=` draws at random.
ORACLE_SEED ?= $(shell git rev-parse HEAD:eqx_logs HEAD:tests 2>/dev/null | cksum | cut -d' ' -f1)

test-oracles: .venv/.installed
	$(ORACLES_FULL) .venv/bin/python -m pytest -q $(DURATIONS) $(ORACLE_WORKERS) \
		$(if $(ORACLE_SEED),--hypothesis-seed=$(ORACLE_SEED)) $(ORACLES)

test-fast: .venv/.installed
	$(TEST_ENV) $(ORACLES_SHARED) .venv/bin/python -m pytest -q $(WORKERS) -m fast

test312: .venv312/.installed
	$(TEST312_ENV) $(ORACLES_SHARED) .venv312/bin/python -m pytest -q $(DURATIONS) $(WORKERS)

# The mutation check (tests/mutations/): deliberate bugs in the engine, each of which the
# engine's tests must catch (slow: a pytest run per mutation).
mutations: .venv/.installed
	$(TEST_ENV) EQX_LOGS_ORACLE_SHARE=0.25 EQX_LOGS_ORACLE_EXPLORE=0 .venv/bin/python tests/mutations/run.py

bench: .venv/.installed
	.venv/bin/pip install -q -e '.[bench]'
	.venv/bin/python benchmarks/bench_core.py
	.venv/bin/python benchmarks/bench_reductions.py
	.venv/bin/python benchmarks/bench_tap.py
	.venv/bin/python benchmarks/bench_diffrax.py
	.venv/bin/python benchmarks/bench_interval.py
	.venv/bin/python benchmarks/bench_compile.py
	.venv/bin/python benchmarks/bench_devices.py
	.venv/bin/python benchmarks/bench_instrument.py
	.venv/bin/python benchmarks/bench_loop.py --memory
	.venv/bin/python benchmarks/bench_overhead.py
	.venv/bin/python benchmarks/bench_watch.py

lint: .venv/.installed
	.venv/bin/ruff check eqx_logs hydra_plugins tests examples benchmarks docs
	.venv/bin/ruff format --check eqx_logs hydra_plugins tests examples benchmarks docs

# The documentation site (mkdocs.yml, docs/) into site/. Strict: a broken link or
# cross-reference fails the build. `.venv/bin/mkdocs serve` serves it while you edit.
docs: .venv/.installed
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -d site

clean:
	rm -rf .venv .venv312

# tests/golden/: what spool, tap, plant and masking emit, against the recorded jaxprs (the
# interpreter's moves must reproduce them exactly; the default suite checks a fast subset)
golden: .venv/.installed .venv312/.installed
	.venv/bin/python tests/golden/record.py --check
	.venv312/bin/python tests/golden/record.py --check

# only for a change MEANT to change the emitted programs (say so in the commit)
golden-record: .venv/.installed .venv312/.installed
	.venv/bin/python tests/golden/record.py
	.venv312/bin/python tests/golden/record.py
