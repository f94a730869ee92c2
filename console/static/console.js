// The overview's live counts: server-sent events from /events, written with textContent
// only (never as HTML). A run's page: its events from /runs/ID/events, as they commit.
(function () {
  const live = document.getElementById("live");
  if (!live || !window.EventSource) return;
  const source = new EventSource("/events");
  const at = (data, path) => path.split(".").reduce((v, k) => (v == null ? v : v[k]), data);
  source.addEventListener("overview", (event) => {
    const data = JSON.parse(event.data);
    if (data.error) { live.textContent = data.error; return; }
    const ops = data.operations || {};
    data.inbox = (ops["needs-human"] || 0) + (ops["unknown"] || 0) +
      (data.runs["needs-human"] || 0) + data.approvals_pending;
    document.querySelectorAll("[data-live]").forEach((el) => {
      let value = at(data, el.dataset.live);
      if (value == null) value = 0;
      if (typeof value === "number" && !Number.isInteger(value)) value = value.toFixed(1);
      el.textContent = String(value);
    });
    // Marks that hold while a flag does (the backlog's ≈ while it is an estimate).
    document.querySelectorAll("[data-live-shown]").forEach((el) => {
      el.hidden = !at(data, el.dataset.liveShown);
    });
    const body = document.querySelector("#relays tbody");
    if (body && data.relays && data.relays.length) {
      body.replaceChildren(...data.relays.map((r) => {
        const row = document.createElement("tr");
        [r.relay_id, r.dead ? "dead" : r.idle ? "idle" : "busy",
         r.heartbeat_age_s.toFixed(1) + " s ago", String(r.lanes.length)].forEach((text) => {
          const cell = document.createElement("td");
          cell.textContent = text;
          row.appendChild(cell);
        });
        return row;
      }));
    }
    live.textContent = "updated " + new Date().toLocaleTimeString();
  });
  source.onerror = () => { live.textContent = "reconnecting…"; };
})();

// A run's events as they commit (/runs/ID/events). The browser reconnects by itself after a
// break and sends the last event's id: the stream goes on after it, nothing missed or twice.
// "end" comes once the run is finished and everything was sent: then stop (a 204 on a later
// reconnection says the same).
(function () {
  const table = document.getElementById("run-events");
  if (!table || !window.EventSource) return;
  const body = table.querySelector("tbody");
  const status = document.getElementById("run-events-status");
  const KEEP = 500;  // rows shown: the newest
  const KINDS = ["state", "model_response", "tool_result", "log", "effect_sent",
    "effect_confirmed", "approval_requested", "approval_granted", "approval_revoked",
    "approval_spent"];
  const what = (kind, d) => {
    if (d.gone) return "(no longer kept)";
    if (kind === "state") {
      return (d.from || "·") + " → " + d.to + (d.step ? " [" + d.step + "]" : "") +
        (d.reason ? ": " + d.reason : "") + (d.actor ? " (" + d.actor + ")" : "");
    }
    if ("op" in d) return (d.op || "entry " + d.log_seq) + ": " + d.summary + (d.truncated ? "…" : "");
    return Object.entries(d).map(([k, v]) => k + " " + v).join(", ");
  };
  const source = new EventSource(table.dataset.source);
  const add = (event) => {
    const e = JSON.parse(event.data);
    const row = document.createElement("tr");
    row.dataset.seq = String(e.seq);
    [String(e.seq), e.at.slice(0, 19).replace("T", " "), e.kind, what(e.kind, e.data)]
      .forEach((text) => {
        const cell = document.createElement("td");
        cell.textContent = text;
        row.appendChild(cell);
      });
    body.appendChild(row);
    while (body.rows.length > KEEP) body.deleteRow(0);
    body.scrollTop = body.scrollHeight;
    status.textContent = "(live: " + e.seq + " so far)";
  };
  KINDS.forEach((kind) => source.addEventListener(kind, add));
  source.addEventListener("end", () => {
    source.close();
    if (table.dataset.finished === "yes") {
      status.textContent = "(the run is finished: all its events)";
      return;
    }
    // The rest of the page is as it was when it loaded: say so, rather than show a finished
    // run's events under a state it has left.
    status.textContent = "(the run finished after this page was loaded: ";
    const link = document.createElement("a");
    link.href = window.location.pathname;
    link.textContent = "reload for its final state";
    status.appendChild(link);
    status.appendChild(document.createTextNode(")"));
  });
  source.onerror = () => {
    if (source.readyState === EventSource.CLOSED) {
      status.textContent = "(all its events)";
    } else {
      status.textContent = "(reconnecting…)";
    }
  };
})();
