// Dashboard: rates from the overview's counters, polled every second, as
// charts; depth totals from the queue list (polled less often).

import { api } from "../api.js";
import { LineChart, Rates } from "../chart.js";
import { bytes, duration, h, num, rate, setText } from "../format.js";
import { notifyError, poll } from "../ui.js";

const SENT = "#2463eb", DELIVERED = "#1b9e77", ACKED = "#8e44ad", SYNCS = "#b4551f";

function card(id, label) {
  return h("div", { class: "card" }, h("div", { class: "label" }, label),
    h("div", { class: "value", id }, "–"), h("div", { class: "sub", id: `${id}-sub` }, "\u00a0"));
}

function chartPanel(title, series) {
  const canvas = h("canvas", { class: "chart", id: `chart-${series[0].key}` });
  const legend = h("div", { class: "legend" }, series.map((s) =>
    h("span", {}, h("i", { style: `background:${s.color}` }), s.label,
      " ", h("b", { id: `now-${s.key}` }, "–"), "/s")));
  const panel = h("div", { class: "panel" },
    h("div", { class: "chart-head" }, h("h2", {}, title), legend), canvas);
  return { panel, chart: new LineChart(canvas, series) };
}

export function mount(view) {
  const error = h("div", { class: "error-box", hidden: true });
  const cards = h("div", { class: "cards" },
    card("d-uptime", "Uptime"), card("d-store", "Store"), card("d-ha", "HA role"),
    card("d-queues", "Queues"), card("d-depth", "Messages waiting"),
    card("d-inflight", "In flight"), card("d-connections", "Connections"),
    card("d-sent", "Sent since start"));
  const traffic = chartPanel("Messages per second", [
    { key: "sent", label: "sent", color: SENT },
    { key: "delivered", label: "delivered", color: DELIVERED },
    { key: "acked", label: "acked", color: ACKED }]);
  const syncs = chartPanel("Store syncs per second", [
    { key: "syncs", label: "syncs", color: SYNCS },
    { key: "appends", label: "appends", color: "#9aa3b5" }]);
  view.append(h("h1", {}, "Dashboard", h("span", { class: "badge", id: "d-version" }, "")),
    error, cards, h("div", { class: "charts" }, traffic.panel, syncs.panel));

  const rates = new Rates();
  const stopOverview = poll(async () => {
    let o;
    try { o = await api.overview(); } catch (err) {
      error.textContent = err.describe(); error.hidden = false; return;
    }
    error.hidden = true;
    const s = o.stats, store = o.store;
    setText(document.getElementById("d-version"), `v${o.version}`);
    setText(document.getElementById("d-uptime"), duration(o.uptime_seconds));
    setText(document.getElementById("d-store"), store.kind);
    setText(document.getElementById("d-store-sub"),
      store.kind === "dir" ? `flags ${store.dir_flags || "none"}` : `sync: ${store.sync}`);
    setText(document.getElementById("d-ha"), o.ha ? String(o.ha.role ?? o.ha.state ?? "on") : "none");
    setText(document.getElementById("d-ha-sub"), o.ha ? haDetail(o.ha) : "single broker");
    setText(document.getElementById("d-queues"), num(s.queues));
    setText(document.getElementById("d-queues-sub"), `${num(s.topics)} topics`);
    setText(document.getElementById("d-connections"), num(s.connections));
    setText(document.getElementById("d-connections-sub"), "this request included");
    setText(document.getElementById("d-sent"), num(s.sent));
    setText(document.getElementById("d-sent-sub"), `${num(s.acked)} acked`);
    const now = rates.update({ sent: s.sent, delivered: s.delivered, acked: s.acked,
                               syncs: store.syncs ?? 0, appends: store.appends ?? 0 });
    if (!now) return;
    traffic.chart.push([now.sent, now.delivered, now.acked]);
    syncs.chart.push([now.syncs, now.appends]);
    for (const key of ["sent", "delivered", "acked", "syncs", "appends"]) {
      setText(document.getElementById(`now-${key}`), rate(now[key]));
    }
  }, 1000);
  const stopTotals = poll(async () => {
    let list;
    try { list = await api.queues(); } catch (err) { notifyError(err); return; }
    let depth = 0, inFlight = 0, size = 0;
    for (const q of list) { depth += q.depth || 0; inFlight += q.in_flight || 0; size += q.bytes || 0; }
    setText(document.getElementById("d-depth"), num(depth));
    setText(document.getElementById("d-depth-sub"), bytes(size));
    setText(document.getElementById("d-inflight"), num(inFlight));
  }, 10000);  // the whole list: at most every 10 s (10x its time when that is more)
  const redraw = () => { traffic.chart.draw(); syncs.chart.draw(); };
  window.addEventListener("resize", redraw);
  requestAnimationFrame(redraw);  // the empty axes before the first rate
  return { stop() { stopOverview(); stopTotals(); window.removeEventListener("resize", redraw); } };
}

function haDetail(ha) {
  return Object.entries(ha).filter(([k]) => k !== "role")
    .map(([k, v]) => `${k}: ${typeof v === "object" ? JSON.stringify(v) : v}`).join(", ")
    .slice(0, 80);
}
