# Both entry points build their own virtualenv, so a fresh clone needs nothing but python3.
# Another interpreter gets a venv of its own: make test PYTHON=python3.13 VENV=.venv-3.13
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 9999
METRICS_PORT ?= 9998

.PHONY: run test lint clean stress nemesis bench bench-throttle bench-compare bench-guard

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# One stamp per install flavour; both depend on pyproject.toml so a new dependency reinstalls.
$(VENV)/.installed-run: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@ $(VENV)/.installed-run

run: $(VENV)/.installed-run
	$(BIN)/elockd --host $(HOST) --port $(PORT) --metrics-port $(METRICS_PORT)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Two workers for the bulk of the suite (much of it waits on etcd and timers), then
# the latency-bound tests alone, so that nothing runs beside them.
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not serial"
	$(BIN)/python -m pytest -q -m serial

# The safety checker (tests/support/safety.py) for longer than `make test` runs it:
# many clients in several processes, random SIGKILLs, every grant checked; against
# one in-memory server, then against two cluster nodes over a 3-member etcd. Also a
# vanished client host with default flags (its lock freed within --keepalive 30), and
# a vanished waiter's host whose grant went out during the cut (freed within 24 s + 1 s).
# And the in-memory run with five hand-overs to a successor (docs/upgrade.md), which
# clients must not notice, for HANDOVER_STRESS_SECONDS.
# And the cluster under real network partitions (tests/support/partition_lab.py, docs/cluster.md):
# 10 runs of a node cut from etcd (loss, link down, 2 s delay), the stale-watch
# sequence, flapping for 60 s and a 30 s cut, each run's figures printed.
# And 20 schedules of the nemesis (tests/support/nemesis_run.py, docs/cluster.md).
STRESS_SECONDS ?= 60
HANDOVER_STRESS_SECONDS ?= 30
stress: $(VENV)/.installed-test
	STRESS_SECONDS=$(STRESS_SECONDS) $(BIN)/python -m pytest -q -s tests/test_safety.py -k 'not handovers'
	HANDOVER_STRESS_SECONDS=$(HANDOVER_STRESS_SECONDS) $(BIN)/python -m pytest -q -s tests/test_safety.py -k handovers
	VANISH_DEFAULT_FLAGS=1 $(BIN)/python -m pytest -q -s tests/test_hostile.py -k vanished
	CLUSTER_STRESS_SECONDS=$(STRESS_SECONDS) $(BIN)/python -m pytest -q -s tests/test_cluster_safety.py
	PARTITION_STRESS=1 $(BIN)/python -m pytest -q -s tests/test_partition.py
	NEMESIS_SCHEDULES=20 $(BIN)/python -m pytest -q -s tests/test_nemesis.py -k mixed

# The nemesis (docs/cluster.md, "The nemesis"): NEMESIS_SCHEDULES seeded schedules of
# mixed faults against two cluster nodes, every reply checked; prints the seed range,
# the count and every violation with its key's timeline. NEMESIS_SEED=S runs schedule
# S again (alone, unless NEMESIS_SCHEDULES says otherwise). Needs root; not in CI.
# About 30 minutes for 200 on two cores.
NEMESIS_SCHEDULES ?= $(if $(NEMESIS_SEED),1,200)
NEMESIS_SEED ?=
nemesis: $(VENV)/.installed-test
	$(BIN)/python -m tests.support.nemesis_run --schedules $(NEMESIS_SCHEDULES) \
		$(if $(NEMESIS_SEED),--seed $(NEMESIS_SEED))
	NEMESIS_PLANTED=1 $(BIN)/python -m pytest -q -s tests/test_nemesis.py -k catches

# Benchmarks, not tests: elockd beside redis-server (when installed), pinned with
# taskset, ratios printed per row. BENCH_ARGS passes options (see bench/run.py
# --help), e.g. BENCH_ARGS='--seconds 2 --skip hold'.
BENCH_ARGS ?=
bench: $(VENV)/.installed-run
	$(BIN)/python bench/run.py $(BENCH_ARGS)

# The throttle rows only (docs/performance.md, "Throttle"): elockd's `throttle` beside
# Redis running bench/gcra.lua by EVALSHA, with elockd's pair row in the same rounds.
# About 3 minutes.
bench-throttle: $(VENV)/.installed-run
	$(BIN)/python bench/run.py --only throttle --rounds 5 $(BENCH_ARGS)

# The throughput rows of two checkouts side by side (BEFORE: a directory holding an
# elockd package, e.g. `git worktree add /tmp/before HEAD~5`).
BEFORE ?=
bench-compare: $(VENV)/.installed-run
	$(BIN)/python bench/compare.py --before $(BEFORE) $(BENCH_ARGS)

# The step before any change to the request path (docs/performance.md): this tree
# against the commit in bench/BASELINE, 5 alternating rounds; exit 1 when a throughput
# median is below 0.95x the baseline's or bytes per held lock rose more than 5 %.
# Timing, so not part of `make test`. About 8 minutes.
bench-guard: $(VENV)/.installed-run
	$(BIN)/python bench/compare.py --before $$(sed -n '/^[0-9a-f]/{p;q}' bench/BASELINE) \
		--rounds 5 --rows throughput hold --hold-rounds 2 \
		--min-ratio 0.95 --max-bytes-rise 0.05 $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .venv-3.* .pytest_cache .mypy_cache .ruff_cache .hypothesis bench/.build
