"""The operator console in a real browser (Debian's Chromium driven by Playwright) against
real PostgreSQL: an operator settles an unknown outcome from the inbox, the overview counts
change live, a viewer sees no action, a forged form is refused, a run's page shows its events
as they commit.

Screenshots of the pages go to pytest's temporary folder, and to
``$OUTBOXKIT_CONSOLE_SCREENSHOTS`` when it is set (docs/console/ was made that way)."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright
from sqlalchemy import Engine, text

from outbox import App, ClaimedRun, Envelope
from outbox.runs.approvals import request_approval
from outbox.runs.lifecycle import claim, get_run, save_checkpoint, start_run, transition
from tests.e2e.conftest import RelayProcesses, wait_until
from tests.e2e.consumer_app import FIXES_DDL
from tests.e2e.consumer_support import ConsumerProcesses, create_effects, effects, produce
from tests.integration.console_support import LEDGER, PASSWORDS, serving, unknown_order
from tests.integration.worker_support import run_in, running


def _chromium() -> str:
    found = os.environ.get("OUTBOXKIT_CHROMIUM") or shutil.which("chromium") \
        or shutil.which("chromium-browser")
    if not found:
        raise AssertionError("no Chromium: scripts/bootstrap installs Debian's chromium "
                             "(or set OUTBOXKIT_CHROMIUM to a Chromium binary)")
    return found


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        # As root (CI), Chromium's sandbox cannot start: the pages are our own, on loopback.
        launched = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def console(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    # The same page wherever it runs: no lag table of whatever groups share the test broker.
    monkeypatch.delenv("OUTBOXKIT_KAFKA_BOOTSTRAP", raising=False)
    with serving(database_url) as base:
        yield base


def _page(browser: Browser, user: str) -> Any:
    context = browser.new_context(http_credentials={"username": user,
                                                    "password": PASSWORDS[user]},
                                  viewport={"width": 1280, "height": 900})
    return context, context.new_page()


def _shot(page: Page, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    wanted = os.environ.get("OUTBOXKIT_CONSOLE_SCREENSHOTS")
    if wanted:
        Path(wanted).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(wanted) / path.name)


def test_the_backlogs_estimate_mark_follows_the_live_counts(
        browser: Browser, console: str, engine: Engine, tmp_path: Path) -> None:
    from outbox.db.queries import driver_sql  # noqa: PLC0415
    from outbox.settings import OutboxSettings  # noqa: PLC0415

    def cursors_here() -> None:  # as a relay that published everything so far would leave them
        with engine.begin() as conn:
            conn.exec_driver_sql(driver_sql("relay", "ensure_lanes", "outboxkit"),
                                 {"lanes": OutboxSettings().lanes})
            conn.execute(text("UPDATE outboxkit.relay_lanes"
                              " SET cursor_snapshot = pg_current_snapshot()"))

    cursors_here()
    context, page = _page(browser, "olga")
    try:
        page.goto(console + "/")
        mark = page.locator('[data-live-shown="backlog_estimated"]')
        backlog = page.locator('[data-live="backlog"]')
        expect(backlog).to_have_text("0")
        expect(mark).to_be_hidden()
        with engine.begin() as conn:  # one lane past the 256 rows the overview reads
            App().emit_many(conn, [Envelope(topic="orders", type="t", key="one-key",
                                            payload={"n": n}) for n in range(600)])
        expect(mark).to_be_visible(timeout=10_000)  # no reload: an estimate now
        expect(backlog).not_to_have_text("0")
        _shot(page, tmp_path, "overview-estimated")
        cursors_here()
        expect(backlog).to_have_text("0", timeout=10_000)
        expect(mark).to_be_hidden()  # exact again
    finally:
        context.close()


def test_an_operator_settles_an_unknown_outcome_from_the_inbox(
        browser: Browser, console: str, engine: Engine, tmp_path: Path) -> None:
    run_id, op_id = unknown_order(engine, "widget-3")
    context, page = _page(browser, "olga")
    try:
        page.goto(console + "/")
        live = page.locator('[data-live="operations.needs-human"]').first
        expect(live).to_have_text("1")
        expect(page.locator("#live")).to_contain_text("updated")  # the stream is up
        unknown_order(engine, "widget-4")  # a second one, while the page is open
        expect(live).to_have_text("2", timeout=10_000)  # no reload: the live counts
        _shot(page, tmp_path, "overview")

        page.goto(console + "/inbox")
        item = page.locator(f"#op-{op_id}")
        expect(item).to_contain_text("place-order on supplier")
        _shot(page, tmp_path, "inbox")
        applied = item.locator("form", has=page.locator("input[value=confirmed]"))
        applied.locator("input[name=evidence]").fill('{"reference": "PO-4471"}')
        applied.locator("input[name=reason]").fill("seen in the supplier's portal")
        applied.get_by_role("button", name="It was applied").click()
        expect(page.get_by_role("status")).to_contain_text(f"operation {op_id} is confirmed")
        expect(page.locator(f"#op-{op_id}")).to_have_count(0)

        with engine.connect() as conn:
            run = get_run(conn, run_id)
            op = LEDGER.get_operation(conn, op_id)
        assert run.state.value == "done"
        assert (op.status.value, op.resolved_by) == ("confirmed", "olga")

        page.goto(f"{console}/runs/{run_id}")
        expect(page.locator("#timeline")).to_contain_text("done")
        expect(page.locator("#timeline")).to_contain_text("PO-4471")
        _shot(page, tmp_path, "run")
    finally:
        context.close()


def test_a_viewer_sees_no_action_and_a_forged_form_is_refused(
        browser: Browser, console: str, engine: Engine) -> None:
    run_id, op_id = unknown_order(engine, "forged")
    context, page = _page(browser, "vic")
    try:
        page.goto(console + "/inbox")
        expect(page.locator(f"#op-{op_id}")).to_be_visible()
        expect(page.get_by_role("button")).to_have_count(0)
    finally:
        context.close()
    context, page = _page(browser, "olga")
    try:
        page.goto(console + "/inbox")
        # A form like the page's, but without its token (what another site could post).
        page.evaluate("""(opId) => {
            const form = document.createElement("form");
            form.method = "post";
            form.action = "/operations/" + opId + "/resolve";
            for (const [name, value] of [["outcome", "not-applied"], ["reason", "forged"]]) {
                const input = document.createElement("input");
                input.name = name; input.value = value; form.appendChild(input);
            }
            document.body.appendChild(form);
            form.submit();
        }""", str(op_id))
        expect(page.get_by_role("alert")).to_contain_text("CSRF")
    finally:
        context.close()
    with engine.connect() as conn:
        assert LEDGER.get_operation(conn, op_id).status.value == "needs-human"
        assert get_run(conn, run_id).state.value == "waiting"


def test_an_operator_grants_an_approval_and_sees_the_effect_published(  # noqa: PLR0917
        browser: Browser, database_url: str, engine: Engine, relays: RelayProcesses,
        kafka_topic: Callable[..., str], tmp_path: Path) -> None:
    """The run asks for an approval and waits; the operator grants it in the inbox; the
    worker's next step emits the refund; the relay publishes it; the run's page shows the
    broker's proof (partition and offset)."""
    topic = kafka_topic()
    scope = {"tool": "refund", "customer": "cust-7", "amount": 20}
    app = App(database_url=database_url)

    @app.workflow("refund", version="1")
    def refund(job: ClaimedRun[Any]) -> None:
        asked = (job.run.checkpoint or {}).get("approval")
        if asked is None:
            approval = request_approval(job.conn, job.run.id, scope=scope,
                                        expires_at=timedelta(hours=1), reason="refund 20 EUR")
            job.transition("waiting", step="asked", checkpoint={"approval": str(approval.id)},
                           wake_at=timedelta(hours=1))
            return
        if not job.revalidate(uuid.UUID(asked), scope=scope).valid:
            return  # revoked or expired: revalidate moved the run to needs-human
        job.emit(Envelope(topic=topic, type="refund", key="cust-7", payload=scope))
        job.transition("done", step="refunded", evidence={"approval": asked})

    relays.start()
    with running(app), serving(database_url) as console:
        with engine.begin() as conn:
            run = app.start_run(conn, refund, idempotency_key="refund-7")
        run_in(engine, run.id, "waiting", timeout=15)
        context, page = _page(browser, "olga")
        try:
            page.goto(console + "/inbox")
            pending = page.locator("article[id^=approval-]")
            expect(pending).to_contain_text('"amount": 20')
            pending.get_by_role("button", name="Grant").click()
            expect(page.get_by_role("status")).to_contain_text("granted by olga")
            try:
                run_in(engine, run.id, "done", timeout=15)
            except AssertionError:
                with engine.connect() as conn:
                    raise AssertionError(conn.execute(text(
                        "SELECT state, step, reason, not_before, attempts FROM "
                        "outboxkit.agent_runs WHERE id = :i"), {"i": run.id}).all()) from None
            page.goto(f"{console}/runs/{run.id}")
            messages = page.locator("#messages")
            for _ in range(100):  # the relay publishes within its poll; reload until shown
                if "offset" in (messages.text_content() or ""):
                    break
                page.wait_for_timeout(200)
                page.reload()
            expect(messages).to_contain_text("refund")
            expect(messages).to_contain_text("partition 0, offset 0")
            _shot(page, tmp_path, "run-published")
        finally:
            context.close()
    with engine.connect() as conn:
        sent = conn.execute(text("SELECT count(*) FROM outboxkit.outbox_messages "
                                 "WHERE topic = :t"), {"t": topic}).scalar_one()
    assert sent == 1


def test_an_operator_replays_a_dead_letter_and_it_is_handled_once(  # noqa: PLR0917
        browser: Browser, database_url: str, engine: Engine, kafka_bootstrap: str,
        kafka_topic: Callable[..., str], tmp_path: Path) -> None:
    """A consumer dead-letters a message its supplier refuses; someone fixes the cause; the
    operator replays it from the page (twice, as people do): the consumer handles it once."""
    topic = kafka_topic()
    create_effects(engine)
    with engine.begin() as conn:
        conn.execute(text(FIXES_DDL))
    consumers = ConsumerProcesses(database_url, kafka_bootstrap, topic, tmp_path)
    try:
        consumers.start()
        [message_id] = produce(kafka_bootstrap, topic, [{"n": 77, "fail": "until-fixed"}])
        failure_id = wait_for_dead_letter(engine, consumers.group_id, timeout=60)
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO public.consumer_fixes (n) VALUES (77)"))
        with serving(database_url, kafka_bootstrap=kafka_bootstrap) as console:
            context, page = _page(browser, "olga")
            try:
                page.goto(console + "/messages")
                row = page.locator(f"#failure-{failure_id}")
                expect(row).to_contain_text("refuses it until someone fixes it")
                expect(page.locator("#failure-groups")).to_contain_text("1")
                _shot(page, tmp_path, "messages")
                token = row.locator("input[name=csrf]").first.get_attribute("value")
                row.get_by_role("button", name="Replay").click()
                expect(page.get_by_role("status")).to_contain_text("republished")
                expect(page.locator(f"#failure-{failure_id}")).to_have_count(0)
                # A second operator's click, from a page opened before the first: refused.
                again = page.request.post(f"{console}/failures/{failure_id}/replay",
                                          form={"csrf": token or "", "next": "/messages"},
                                          max_redirects=0)
                assert again.status == 409, again.text()
                assert "not dead-lettered" in again.text()
            finally:
                context.close()
        wait_until(lambda: effects(engine).get(message_id) == 1, 60, "the replay handled")
        time.sleep(2)  # and not a second time
        assert effects(engine).get(message_id) == 1
    finally:
        consumers.stop_all()


def wait_for_dead_letter(engine: Engine, group: str, timeout: float) -> int:
    found: list[int] = []

    def dead() -> bool:
        with engine.connect() as conn:
            found[:] = conn.execute(text(
                "SELECT id FROM outboxkit.consumer_failures WHERE consumer_group = :g "
                "AND status = 'dead-lettered'"), {"g": group}).scalars().all()
        return bool(found)

    wait_until(dead, timeout, "the message to be dead-lettered")
    return found[0]


def test_a_runs_page_shows_its_events_as_they_commit(
        browser: Browser, console: str, engine: Engine, tmp_path: Path) -> None:
    """The run's page follows /runs/ID/events: a message the run emits and its move to
    done appear while the page is open, and the list stops once the run is finished."""
    app = App()
    with engine.begin() as conn:
        run = start_run(conn, workflow="wf", workflow_version="1", idempotency_key="followed")
    with engine.begin() as conn:
        got = claim(conn, worker="w", lease_seconds=120)
        assert got is not None
        lease = save_checkpoint(conn, got.lease, {"n": 1}, log={
            0: {"op": "agent.model.request", "result": {"text": "order 3 widgets"}}})
    context, page = _page(browser, "vic")
    try:
        page.goto(f"{console}/runs/{run.id}")
        rows = page.locator("#run-events tbody tr")
        expect(rows).to_have_count(3)
        expect(rows.nth(2)).to_contain_text("order 3 widgets")
        with engine.begin() as conn:  # while the page is open
            app.emit(conn, Envelope(topic="orders", type="order.submit", key="acme",
                                    payload={"qty": 3}, run_id=run.id))
        expect(rows).to_have_count(4, timeout=10_000)
        expect(rows.nth(3)).to_contain_text("effect_sent")
        expect(rows.nth(3)).to_contain_text("key acme")
        with engine.begin() as conn:
            transition(conn, lease, "done", evidence={"ok": True})
        expect(rows).to_have_count(5, timeout=10_000)
        expect(rows.nth(4)).to_contain_text("running → done")
        # The page loaded while the run was running: it says the rest of it is older.
        status = page.locator("#run-events-status")
        expect(status).to_contain_text("finished after this page was loaded")
        _shot(page, tmp_path, "run-events")
        status.locator("a").click()
        expect(page.locator("h1")).to_contain_text("done")
        expect(page.locator("#run-events-status")).to_contain_text(
            "the run is finished: all its events")
        expect(rows).to_have_count(5)
    finally:
        context.close()
