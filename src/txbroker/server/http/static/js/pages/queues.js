// The queue list: filter, sort and page in the browser (only one page of rows
// is in the DOM, so 10,000 queues stay quick); rates from successive polls.

import { api } from "../api.js";
import { bytes, h, num, rate, setText, syncRows } from "../format.js";
import { poll } from "../ui.js";

const PAGE_SIZES = [25, 50, 100, 250];
const COLUMNS = [
  // [key, label, numeric, width]
  ["name", "Name", false, "auto"],
  ["kind", "Kind", false, "70px"],
  ["depth", "Depth", true, "100px"],
  ["in_flight", "In flight", true, "100px"],
  ["consumers", "Consumers", true, "110px"],
  ["bytes", "Bytes", true, "95px"],
  ["in_rate", "In/s", true, "75px"],
  ["out_rate", "Out/s", true, "75px"],
  ["enqueued", "Enqueued", true, "100px"],
  ["dead_lettered", "Dead-lettered", true, "130px"],
];
// Kept across visits of the page (this tab only).
const state = { filter: "", kind: "", sort: "name", desc: false, page: 0, size: 50 };

export function mount(view) {
  const error = h("div", { class: "error-box", hidden: true });
  const filter = h("input", { type: "search", id: "queue-filter", placeholder: "Filter by name…",
                              value: state.filter, style: "width:260px" });
  const kind = h("select", { id: "queue-kind" },
    h("option", { value: "" }, "queues and topics"), h("option", { value: "queue" }, "queues"),
    h("option", { value: "topic" }, "topics"));
  kind.value = state.kind;
  const size = h("select", { id: "queue-page-size" },
    PAGE_SIZES.map((n) => h("option", { value: String(n) }, `${n} per page`)));
  size.value = String(state.size);
  const count = h("span", { class: "muted", id: "queue-count" }, "\u00a0");
  const head = h("tr", {}, COLUMNS.map(([key, label, numeric]) =>
    h("th", { class: `sortable${numeric ? " num" : ""}`, dataset: { sort: key },
              onclick: () => sortBy(key) }, label, h("span", { class: "arrow" }))));
  const tbody = h("tbody", { id: "queue-rows" });
  const empty = h("div", { class: "empty", hidden: true }, "No queue matches.");
  const prev = h("button", { class: "small", id: "queue-prev", onclick: () => turn(-1) }, "‹ Previous");
  const next = h("button", { class: "small", id: "queue-next", onclick: () => turn(1) }, "Next ›");
  const pageInfo = h("span", { id: "queue-page" }, "");
  view.append(h("h1", {}, "Queues and topics"), error,
    h("div", { class: "toolbar" }, filter, kind, h("span", { class: "grow" }), count, size),
    h("div", { class: "table-wrap" },
      h("table", { id: "queue-table" },
        h("colgroup", {}, COLUMNS.map(([, , , width]) => h("col", { style: `width:${width}` }))),
        h("thead", {}, head), tbody), empty),
    h("div", { class: "pager" }, prev, pageInfo, next));

  let queues = [];
  let previous = new Map();  // name -> {enqueued, dequeued, at}
  const rates = new Map();   // name -> {in_rate, out_rate}

  function sortBy(key) {
    if (state.sort === key) state.desc = !state.desc;
    else { state.sort = key; state.desc = key !== "name" && key !== "kind"; }
    render();
  }
  function turn(delta) { state.page += delta; render(); }
  filter.addEventListener("input", () => { state.filter = filter.value; state.page = 0; render(); });
  kind.addEventListener("change", () => { state.kind = kind.value; state.page = 0; render(); });
  size.addEventListener("change", () => { state.size = Number(size.value); state.page = 0; render(); });

  function value(q, key) {
    if (key === "in_rate" || key === "out_rate") return rates.get(q.name)?.[key] ?? 0;
    return q[key];
  }

  function render() {
    const text = state.filter.trim().toLowerCase();
    let shown = queues.filter((q) => (!state.kind || q.kind === state.kind) &&
      (!text || q.name.toLowerCase().includes(text)));
    const key = state.sort, sign = state.desc ? -1 : 1;
    shown.sort((a, b) => {
      const x = value(a, key), y = value(b, key);
      const order = typeof x === "number" && typeof y === "number" ? x - y
        : String(x ?? "").localeCompare(String(y ?? ""));
      return order * sign || a.name.localeCompare(b.name);
    });
    const pages = Math.max(1, Math.ceil(shown.length / state.size));
    state.page = Math.min(Math.max(state.page, 0), pages - 1);
    const start = state.page * state.size;
    const page = shown.slice(start, start + state.size);
    syncRows(tbody, page, (q) => q.name, createRow, updateRow);
    empty.hidden = page.length > 0;
    setText(count, `${num(shown.length)} of ${num(queues.length)}`);
    setText(pageInfo, `page ${num(state.page + 1)} of ${num(pages)}`);
    prev.disabled = state.page === 0;
    next.disabled = state.page >= pages - 1;
    for (const th of head.children) {
      setText(th.lastChild, th.dataset.sort === key ? (state.desc ? "▼" : "▲") : "");
    }
  }

  function createRow(q) {
    const link = h("a", { href: `#/queues/${encodeURIComponent(q.name)}` }, q.name);
    return h("tr", { dataset: { queue: q.name } }, h("td", { title: q.name }, link),
      COLUMNS.slice(1).map(([key, , numeric]) =>
        h("td", { class: numeric ? "num" : "", dataset: { field: key } })));
  }
  function updateRow(row, q) {
    const cells = row.cells;
    COLUMNS.forEach(([key], i) => {
      if (i === 0) return;
      const v = value(q, key);
      let text;
      if (key === "bytes") text = bytes(v);
      else if (key === "in_rate" || key === "out_rate") text = rate(v);
      else text = typeof v === "number" ? num(v) : String(v ?? "–");
      setText(cells[i], text);
    });
  }

  const stop = poll(async () => {
    try { queues = await api.queues(); } catch (err) {
      error.textContent = err.describe(); error.hidden = false; return;
    }
    error.hidden = true;
    const now = performance.now(), seen = new Map();
    for (const q of queues) {
      const last = previous.get(q.name);
      if (last && now > last.at) {
        const seconds = (now - last.at) / 1000;
        rates.set(q.name, { in_rate: Math.max(0, q.enqueued - last.enqueued) / seconds,
                            out_rate: Math.max(0, q.dequeued - last.dequeued) / seconds });
      }
      seen.set(q.name, { enqueued: q.enqueued, dequeued: q.dequeued, at: now });
    }
    previous = seen;
    for (const name of rates.keys()) if (!seen.has(name)) rates.delete(name);
    render();
    window.__queuesRendered = performance.now();  // read by bench/console_bench.py
  }, 2000);
  return { stop };
}
