// The overview's live counts: server-sent events from /events, written with textContent
// only (never as HTML). Nothing here on the other pages.
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
