# The two commands of the README: `make demo` runs the main job, `make test` the tests.
# Both install what they need first (scripts/bootstrap).
VENV := .venv/bin
SERVICES := $(VENV)/python -m outbox.testing.services

.PHONY: demo test lint unit bench bench-quick bench-peers faults soak bootstrap services-up services-down services-status clean

bootstrap:
	@bash scripts/bootstrap

demo: bootstrap
	$(VENV)/python examples/demo.py

lint: bootstrap
	$(VENV)/ruff check .
	$(VENV)/mypy
	$(VENV)/lint-imports

# The whole suite with kafka-python (the default client), then the Kafka contract suite
# (relay, consumers, crashes, TLS/SASL, the fault harness's CI subset) with confluent-kafka.
test: lint
	$(VENV)/pytest
	OUTBOXKIT_KAFKA_CLIENT=confluent $(VENV)/pytest -m kafka_contract

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

# The fault harness (the CI subset is part of `make test`): a table and faults-report.json.
# SEED=N replays a run; `make soak MINUTES=30` loops every scenario for that long.
faults: bootstrap
	$(VENV)/python -m tests.faults $(if $(SEED),--seed $(SEED))

soak: bootstrap
	$(VENV)/python -m tests.faults --soak $(or $(MINUTES),30) $(if $(SEED),--seed $(SEED))

services-up: bootstrap
	@$(SERVICES) up

services-down:
	@$(SERVICES) down

services-status:
	@$(SERVICES) status

clean: services-down
	rm -rf .services .mypy_cache .ruff_cache
