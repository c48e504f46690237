// The transaction router: facilities, their partitions with the servers that serve
// them (role, site, the transaction each holds), transactions in flight by state, the
// router's counters; exception transactions with commit / discard (each confirmed).

import { api } from "../api.js";
import { h, num, setText, syncRows } from "../format.js";
import { confirmed, poll } from "../ui.js";

const STATES = ["SENDING", "VREQ", "COMMITTING", "ABORTING"];

export function mount(view) {
  const error = h("div", { class: "error-box", hidden: true });
  const counters = h("p", { class: "muted", id: "router-counters" });
  const partitions = h("tbody", { id: "router-partitions" });
  const exceptions = h("tbody", { id: "router-exceptions" });
  const noFacility = h("div", { class: "empty", hidden: true, id: "router-empty" },
    "No facility is defined (txbroker router define, or [router.facilities] in the config).");
  const noException = h("div", { class: "empty", hidden: true, id: "router-no-exceptions" },
    "No exception transactions.");
  view.append(h("h1", {}, "Transaction router"), error, counters,
    h("h2", {}, "Partitions"),
    h("div", { class: "table-wrap" }, h("table", {},
      h("thead", {}, h("tr", {}, h("th", {}, "Facility"), h("th", {}, "Partition"),
        h("th", {}, "Key range"), h("th", {}, "Servers"), h("th", { class: "num" }, "Waiting"),
        h("th", {}, "Transactions in flight"))), partitions), noFacility),
    h("h2", {}, "Exception transactions"),
    h("p", { class: "muted" }, "Rejected with SRVDIED after three strikes (docs/router.md). " +
      "Commit one by hand only when its servers can apply it; discard leaves it rejected."),
    h("div", { class: "table-wrap" }, h("table", {},
      h("thead", {}, h("tr", {}, h("th", {}, "Tid"), h("th", {}, "Facility"),
        h("th", {}, "Partitions"), h("th", { class: "num" }, "Strikes"), h("th", {}, ""))),
      exceptions), noException));

  async function act(kind, e) {
    const commit = kind === "commit";
    await confirmed(`${commit ? "Commit" : "Discard"} ${e.tid}?`, commit
      ? "It is presented once more, decided (UNCERTAIN then ACCEPTED), to a server of each " +
        "of its partitions."
      : "The router forgets it; it stays rejected.", commit ? "Commit" : "Discard",
    () => (commit ? api.routerCommit(e.tid) : api.routerDiscard(e.tid)),
    (r) => `${e.tid}: ${String(r.state).toLowerCase()}.`);
    refresh();
  }

  async function refresh() {
    let shown, found;
    try {
      [shown, found] = await Promise.all([api.router(), api.routerExceptions()]);
    } catch (err) {
      error.textContent = err.describe(); error.hidden = false; return;
    }
    error.hidden = true;
    const c = shown.stats || {};
    setText(counters, `committed ${num(c.committed ?? 0)} · rejected ${num(c.rejected ?? 0)}` +
      ` · replays ${num(c.replays ?? 0)} · preempted ${num(c.preempted ?? 0)}` +
      ` · exceptions ${num(c.exceptions ?? 0)}`);
    const rows = [];
    for (const f of shown.facilities) {
      const inFlight = STATES.filter((s) => f.transactions[s])
        .map((s) => `${s} ${num(f.transactions[s])}`).join(", ") || "–";
      for (const p of f.partitions) rows.push({ f, p, inFlight, key: `${f.name}/${p.name}` });
    }
    syncRows(partitions, rows, (r) => r.key, (r) => h("tr", { dataset: { partition: r.key } },
      h("td", {}), h("td", {}), h("td", { class: "mono" }), h("td", {}),
      h("td", { class: "num" }), h("td", {})), (row, r) => {
      const servers = r.p.servers.map((s) => `#${s.controller} ${s.role}` +
        (s.busy_tid ? ` (${s.site}: ${s.busy_tid})` : "")).join(", ") || "none";
      const values = [r.f.name, r.p.name, `${r.p.low} … ${r.p.high}`, servers,
        num(r.p.waiting), r.inFlight];
      values.forEach((v, i) => setText(row.cells[i], String(v)));
    });
    noFacility.hidden = rows.length > 0;
    syncRows(exceptions, found, (e) => e.tid, (e) => {
      const row = h("tr", { dataset: { tid: e.tid } }, h("td", { class: "mono" }), h("td", {}),
        h("td", {}), h("td", { class: "num" }), h("td", {}, h("div", { class: "actions" },
          h("button", { class: "small", dataset: { act: "commit" } }, "Commit…"),
          h("button", { class: "small", dataset: { act: "discard" } }, "Discard…"))));
      row.exception = e;
      for (const button of row.querySelectorAll("button")) {
        button.addEventListener("click", () => act(button.dataset.act, row.exception));
      }
      return row;
    }, (row, e) => {
      row.exception = e;
      const values = [e.tid, e.facility, (e.partitions || []).join(", "), num(e.strikes ?? 0)];
      values.forEach((v, i) => setText(row.cells[i], String(v)));
    });
    noException.hidden = found.length > 0;
  }
  return { stop: poll(refresh, 2000) };
}
