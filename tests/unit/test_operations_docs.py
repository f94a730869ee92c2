"""docs/operations.md shows the supplier's `System` adapter as it really is, and documents
what settling an operation does to its run and what run retention keeps."""

from __future__ import annotations

import re
from pathlib import Path

from dedup.ledger import OnSettle

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "operations.md").read_text()
MARKER = "<!-- excerpt: examples/supplier_client.py -->"


def _excerpt() -> str:
    after = DOC.split(MARKER, 1)[1]
    match = re.match(r"\s*```python\n(.*?)```", after, re.DOTALL)
    assert match is not None, "the marker must be followed by a ```python block"
    return match.group(1)


def test_the_adapter_in_the_docs_is_a_verbatim_excerpt_of_the_example() -> None:
    """Edit examples/supplier_client.py and the doc's copy goes stale: this test says so."""
    excerpt = _excerpt()
    source = (ROOT / "examples" / "supplier_client.py").read_text()
    assert excerpt in source, "docs/operations.md's adapter differs from supplier_client.py"
    for part in ("def place_order(", "def order_status(", "def system(", "return Applied(",
                 "return Refused(", "return Found(", "return NotFound(", "return Unclear("):
        assert part in excerpt, f"the adapter in the docs is not complete: {part} missing"


def test_the_excerpt_runs_as_a_module() -> None:
    """The excerpt is the whole adapter, imports included: it runs on its own."""
    namespace: dict[str, object] = {"__name__": "excerpt"}
    exec(compile(_excerpt(), "operations.md excerpt", "exec"), namespace)  # noqa: S102
    client_class = namespace["SupplierClient"]
    assert isinstance(client_class, type)
    system = client_class("http://127.0.0.1:9").system()
    assert system.name == "supplier"


def test_run_settling_and_run_retention_are_documented() -> None:
    assert "## The run that waits on an operation" in DOC
    for choice in OnSettle:
        assert f'`"{choice.value}"`' in DOC, choice
    assert "### Retention of runs (`outbox purge`)" in DOC
    for fact in ("What goes", "What stays", "Never purged", "The idempotency key keeps answering"):
        assert fact in DOC, fact
