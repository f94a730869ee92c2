# The two commands of the README: `make demo` runs the main job, `make test` the tests.
# Both install what they need first (scripts/bootstrap).
VENV := .venv/bin
SERVICES := $(VENV)/python -m outbox.testing.services

.PHONY: demo test lint unit bootstrap services-up services-down services-status clean

bootstrap:
	@bash scripts/bootstrap

demo: bootstrap
	$(VENV)/python examples/demo.py

lint: bootstrap
	$(VENV)/ruff check .
	$(VENV)/mypy
	$(VENV)/lint-imports

test: lint
	$(VENV)/pytest

services-up: bootstrap
	@$(SERVICES) up

services-down:
	@$(SERVICES) down

services-status:
	@$(SERVICES) status

clean: services-down
	rm -rf .services .mypy_cache .ruff_cache
