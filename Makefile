# The two commands of the README: `make demo` runs the main job, `make test` the tests.
# Both install what they need first (scripts/bootstrap).
VENV := .venv/bin
SERVICES := $(VENV)/python -m outbox.testing.services

.PHONY: demo demo-agent console test lint unit bench bench-quick bench-peers faults faults-soak soak bootstrap services-up services-down services-status clean

bootstrap:
	@bash scripts/bootstrap

demo: bootstrap
	$(VENV)/python examples/demo.py

# The operator console on the demo's services (run `make demo` first): http://127.0.0.1:8470/
console: bootstrap
	$(VENV)/python examples/console.py

# The durable pydantic-ai agent: a support agent reorders from the supplier while its worker
# is killed mid-run (examples/support_agent); no model step asked twice, one order per run.
demo-agent: bootstrap
	$(VENV)/python examples/demo_agent.py

lint: bootstrap
	$(VENV)/ruff check .
	$(VENV)/mypy
	$(VENV)/lint-imports

# The whole suite, once, on WORKERS processes (the tests mostly wait on PostgreSQL, Kafka
# and child processes; each has its own database and topics). Tests where the Kafka client
# matters run with both clients (the kafka_client fixture in tests/conftest.py). The local
# services start here, before the workers, so that the workers do not race to start them;
# they are stopped afterwards unless they were already running. A service given through
# OUTBOXKIT_TEST_DATABASE_URL / OUTBOXKIT_TEST_KAFKA_BOOTSTRAP is used as given.
# PYTEST_ARGS=... passes more to pytest.
WORKERS ?= 4
test: lint
	@set -e; \
	if [ -z "$$OUTBOXKIT_TEST_DATABASE_URL" ] || [ -z "$$OUTBOXKIT_TEST_KAFKA_BOOTSTRAP" ]; then \
	  $(SERVICES) status >/dev/null 2>&1 || trap '$(SERVICES) down' EXIT; \
	  found=$$($(SERVICES) up); \
	  given() { echo "$$found" | sed -n "s/^export $$1=//p"; }; \
	  export OUTBOXKIT_TEST_DATABASE_URL="$${OUTBOXKIT_TEST_DATABASE_URL:-$$(given OUTBOXKIT_TEST_DATABASE_URL)}"; \
	  export OUTBOXKIT_TEST_KAFKA_BOOTSTRAP="$${OUTBOXKIT_TEST_KAFKA_BOOTSTRAP:-$$(given OUTBOXKIT_TEST_KAFKA_BOOTSTRAP)}"; \
	fi; \
	$(VENV)/pytest -n $(WORKERS) --dist load $(PYTEST_ARGS)

# The benchmark suite on throwaway services: a table, bench/results/latest.json, two SVGs.
# Minutes long; run it on a quiet machine. bench-quick is a one-minute smoke run.
bench: bootstrap
	$(VENV)/python bench/suite.py

bench-quick: bootstrap
	$(VENV)/python bench/suite.py --quick

# Debezium (Kafka Connect + Outbox Event Router, jars from Maven Central) side by side with
# the relay, on its own throwaway PostgreSQL (wal_level=logical) and Kafka; 4-8 minutes.
# ARGS="--quick" for a smoke run, ARGS="--json peers.json" to keep the figures.
bench-peers: bootstrap
	$(VENV)/python bench/peers/debezium.py $(ARGS)

# The fault harness (the CI subset is part of `make test`): a table and faults-report.json,
# then the cluster set (3 Kafka nodes, PostgreSQL + synchronous standby; ROUNDS=3 rounds):
# faults-report-cluster.json, then the network set (every client behind a Toxiproxy of its
# own: partitions, slow links, half-open connections, a relay fenced while cut from
# PostgreSQL): faults-report-network.json. SEED=N replays a run; `make faults-soak
# MINUTES=30` loops every scenario for that long, then the cluster set for as long. Every
# set runs even if one before it failed; the target fails if any did.
faults: bootstrap
	@status=0; \
	$(VENV)/python -m tests.faults $(if $(SEED),--seed $(SEED)) || status=1; \
	$(VENV)/python -m tests.faults --network $(if $(SEED),--seed $(SEED)) || status=1; \
	$(VENV)/python -m tests.faults --cluster --rounds $(or $(ROUNDS),3) \
		$(if $(SEED),--seed $(SEED)) || status=1; \
	exit $$status

faults-soak: bootstrap
	@status=0; \
	$(VENV)/python -m tests.faults --soak $(or $(MINUTES),30) $(if $(SEED),--seed $(SEED)) \
		|| status=1; \
	$(VENV)/python -m tests.faults --cluster --soak $(or $(MINUTES),30) \
		$(if $(SEED),--seed $(SEED)) || status=1; \
	exit $$status

# The leak soak (tests/faults/soak.py): the supplier-order pipeline under a steady load for
# MINUTES (default 60) on throwaway services, nothing killed; every daemon's RSS, open
# descriptors, threads and PostgreSQL connections sampled each minute. Fails if any of them
# grows more than 10 % from the second quarter of the run to the last (the first is
# warm-up), if a daemon dies, or if an order is lost or placed twice. Writes
# soak-report.json and soak.svg (the curves) at the repository root.
soak: bootstrap
	$(VENV)/python -m tests.faults.soak --minutes $(or $(MINUTES),60)

services-up: bootstrap
	@$(SERVICES) up

services-down:
	@$(SERVICES) down

services-status:
	@$(SERVICES) status

clean: services-down
	rm -rf .services .mypy_cache .ruff_cache
