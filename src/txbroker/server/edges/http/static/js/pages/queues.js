// The queue list: the broker filters, sorts and pages it (GET /api/queues?limit=…),
// so only one page of queues crosses the wire and is in the DOM, and 10,000
// queues stay quick. Rates come from successive polls of the rows shown.

import { api } from "../api.js";
import { bytes, h, num, rate, setText, syncRows } from "../format.js";
import { poll } from "../ui.js";

const PAGE_SIZES = [25, 50, 100, 250];
// The page's first full list, for bench/console_bench.py (once per page load).
const RENDERED_MARK = "txbroker:queues-rendered";
// Milliseconds of quiet typing before the filter asks the broker.
const FILTER_DELAY = 200;
const COLUMNS = [
  // [key, label, numeric, width, sortable by the broker]
  ["name", "Name", false, "auto", true],
  ["kind", "Kind", false, "70px", true],
  ["depth", "Depth", true, "100px", true],
  ["in_flight", "In flight", true, "100px", true],
  ["consumers", "Consumers", true, "110px", true],
  ["bytes", "Bytes", true, "95px", true],
  ["in_rate", "In/s", true, "75px", false],
  ["out_rate", "Out/s", true, "75px", false],
  ["enqueued", "Enqueued", true, "100px", true],
  ["dead_lettered", "Dead-lettered", true, "130px", true],
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
  const head = h("tr", {}, COLUMNS.map(([key, label, numeric, , sortable]) =>
    h("th", { class: `${sortable ? "sortable" : ""}${numeric ? " num" : ""}`,
              dataset: { sort: key }, title: sortable ? "sort" : "rate over the last poll",
              onclick: sortable ? () => sortBy(key) : null },
      label, h("span", { class: "arrow" }))));
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

  let total = 0;
  let asked = 0;             // the latest request: older answers are dropped
  let previous = new Map();  // name -> {enqueued, dequeued, at}
  const rates = new Map();   // name -> {in_rate, out_rate}
  let filterTimer = null;

  function sortBy(key) {
    if (state.sort === key) state.desc = !state.desc;
    else { state.sort = key; state.desc = key !== "name" && key !== "kind"; }
    state.page = 0;
    refresh();
  }
  function turn(delta) { state.page += delta; refresh(); }
  filter.addEventListener("input", () => {
    clearTimeout(filterTimer);
    filterTimer = setTimeout(() => { state.filter = filter.value; state.page = 0; refresh(); },
                             FILTER_DELAY);
  });
  kind.addEventListener("change", () => { state.kind = kind.value; state.page = 0; refresh(); });
  size.addEventListener("change", () => { state.size = Number(size.value); state.page = 0; refresh(); });

  function value(q, key) {
    if (key === "in_rate" || key === "out_rate") return rates.get(q.name)?.[key];
    return q[key];
  }

  async function refresh() {
    const mine = ++asked;
    const wanted = { ...state };
    let answer;
    try {
      answer = await api.queuePage({ limit: wanted.size, offset: wanted.page * wanted.size,
        name: wanted.filter.trim(), kind: wanted.kind, sort: wanted.sort,
        order: wanted.desc ? "desc" : "asc" });
    } catch (err) {
      if (mine === asked) { error.textContent = err.describe(); error.hidden = false; }
      return;
    }
    if (mine !== asked) return;
    error.hidden = true;
    total = answer.total;
    const pages = Math.max(1, Math.ceil(total / wanted.size));
    if (wanted.page >= pages && total > 0) {  // the list shrank under this page
      state.page = pages - 1;
      refresh();
      return;
    }
    updateRates(answer.queues);
    render(answer.queues, pages);
    if (!performance.getEntriesByName(RENDERED_MARK).length) performance.mark(RENDERED_MARK);
  }

  function updateRates(queues) {
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
  }

  function render(queues, pages) {
    syncRows(tbody, queues, (q) => q.name, createRow, updateRow);
    empty.hidden = queues.length > 0;
    const filtered = state.filter.trim() || state.kind;
    setText(count, filtered ? `${num(total)} ${total === 1 ? "match" : "matches"}`
      : `${num(total)} in all`);
    setText(pageInfo, `page ${num(state.page + 1)} of ${num(pages)}`);
    prev.disabled = state.page === 0;
    next.disabled = state.page >= pages - 1;
    for (const th of head.children) {
      setText(th.lastChild, th.dataset.sort === state.sort ? (state.desc ? "▼" : "▲") : "");
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

  const stop = poll(refresh, 2000);
  return { stop() { stop(); clearTimeout(filterTimer); } };
}
