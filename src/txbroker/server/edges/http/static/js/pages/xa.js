// XA branches: state and age; heuristic commit / rollback of a prepared branch,
// forget of a heuristically completed one (each behind a confirmation).

import { api } from "../api.js";
import { duration, h, num, setText, syncRows } from "../format.js";
import { confirmed, poll } from "../ui.js";

const HEURISTIC = new Set(["heuristic_committed", "heuristic_rolled_back"]);

export function mount(view) {
  const error = h("div", { class: "error-box", hidden: true });
  const tbody = h("tbody", { id: "xa-rows" });
  const empty = h("div", { class: "empty", hidden: true, id: "xa-empty" }, "No XA branches.");
  const widths = ["auto", "190px", "100px", "70px", "105px", "90px", "300px"];
  view.append(h("h1", {}, "XA branches"), error,
    h("p", { class: "muted" }, "A prepared branch waits for its transaction manager. Decide it " +
      "by hand only when the manager is gone for good: a heuristic decision that differs from " +
      "the manager's is reported to it as a heuristic outcome (docs/xa.md)."),
    h("div", { class: "table-wrap" }, h("table", {},
      h("colgroup", {}, widths.map((w) => h("col", { style: `width:${w}` }))),
      h("thead", {}, h("tr", {}, h("th", {}, "Xid"), h("th", {}, "State"),
        h("th", { class: "num" }, "Age"), h("th", { class: "num" }, "Sent"),
        h("th", { class: "num" }, "Consumed"), h("th", { class: "num" }, "Session"),
        h("th", {}, ""))), tbody), empty));

  async function act(kind, b) {
    const texts = {
      commit: ["Heuristically commit", "Its sends become visible and its consumed messages " +
        "are gone, whatever the transaction manager decides.", "Commit",
        () => api.xaCommit(b.xid)],
      rollback: ["Heuristically roll back", "Its sends are dropped and its consumed messages " +
        "return to their queues, whatever the transaction manager decides.", "Roll back",
        () => api.xaRollback(b.xid)],
      forget: ["Forget", "The broker stops remembering this heuristic outcome.", "Forget",
        () => api.xaForget(b.xid)],
    };
    const [title, text, label, run] = texts[kind];
    await confirmed(`${title} ${b.xid}?`, text, label, run,
      (r) => r.forgotten ? `Forgot ${b.xid}.` : `${b.xid}: ${r.state.replaceAll("_", " ")}.`);
    refresh();
  }

  async function refresh() {
    let found;
    try { found = await api.xa(); } catch (err) {
      error.textContent = err.describe(); error.hidden = false; return;
    }
    error.hidden = true;
    found.sort((a, b) => b.age_ms - a.age_ms || a.xid.localeCompare(b.xid));
    syncRows(tbody, found, (b) => b.xid, (b) => {
      const buttons = {
        commit: h("button", { class: "small", dataset: { act: "commit" } }, "Commit…"),
        rollback: h("button", { class: "small", dataset: { act: "rollback" } }, "Roll back…"),
        forget: h("button", { class: "small", dataset: { act: "forget" } }, "Forget…"),
      };
      const row = h("tr", { dataset: { xid: b.xid } },
        h("td", { class: "mono", title: b.xid }, b.xid), h("td", { dataset: { field: "state" } }),
        h("td", { class: "num" }), h("td", { class: "num" }), h("td", { class: "num" }),
        h("td", { class: "num" }),
        h("td", {}, h("div", { class: "actions" }, Object.values(buttons))));
      row.branch = b;
      for (const [kind, button] of Object.entries(buttons)) {
        button.addEventListener("click", () => act(kind, row.branch));
      }
      return row;
    }, (row, b) => {
      row.branch = b;
      const cells = row.cells;
      setText(cells[1], b.state.replaceAll("_", " "));
      cells[1].className = `state-${b.state}`;
      setText(cells[2], duration(b.age_ms / 1000));
      setText(cells[3], num(b.sent));
      setText(cells[4], num(b.consumed));
      setText(cells[5], b.session === null || b.session === undefined ? "–" : String(b.session));
      const prepared = b.state === "prepared";
      for (const button of row.querySelectorAll("button")) {
        const kind = button.dataset.act;
        button.disabled = kind === "forget" ? !HEURISTIC.has(b.state) : !prepared;
      }
    });
    empty.hidden = found.length > 0;
  }
  return { stop: poll(refresh, 2000) };
}
