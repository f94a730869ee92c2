"""The support agent example: a pydantic-ai agent as a durable outboxkit run.

A customer asks about a late order; the agent looks it up (a read-only tool, run inline),
reorders the item from the supplier (an effect tool: a Kafka message through the outbox,
placed at the HTTP supplier by a consumer at most once), waits for the supplier's answer
and resumes with its order reference. ``make demo-agent`` runs it while killing the worker.

* :mod:`.agent` — the agent, its tools and its :class:`outbox_agents.OutboxDurability`
  capability (what you write);
* :mod:`.script` — the scripted model standing in for an LLM (no network, no API key);
* :mod:`.worker` — ``outbox worker examples.support_agent.worker:app``: drives the runs;
* :mod:`.consumer` — ``python -m consumers examples.support_agent.consumer:app``;
* :mod:`.real_model` — the same agent on a real model provider.
"""
