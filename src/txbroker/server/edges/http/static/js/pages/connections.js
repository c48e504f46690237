// Connections: every native, STOMP and AMQP connection; close one (with confirmation).
// AMQP connections' channels are listed below them (number, consumers, prefetch,
// unacked, confirm/tx mode). HTTP requests are sessions too, but each lasts one
// request: they are not listed.

import { api } from "../api.js";
import { duration, h, num, setText, syncRows } from "../format.js";
import { confirmed, poll } from "../ui.js";

const COLUMNS = [["id", "Id", "60px"], ["protocol", "Protocol", "90px"], ["user", "User", "110px"],
  ["address", "Address", "auto"], ["age", "Open for", "100px"], ["subscriptions", "Subs", "70px"],
  ["unacked", "Unacked", "85px"], ["transactions", "Tx", "55px"], ["xa_branch", "XA branch", "150px"],
  ["close", "", "90px"]];
const NUMERIC = new Set(["id", "subscriptions", "unacked", "transactions"]);
const CHANNEL_COLUMNS = [["connection", "Connection", "110px"], ["number", "Channel", "90px"],
  ["consumers", "Consumers", "100px"], ["consumer_tags", "Consumer tags", "auto"],
  ["prefetch", "Prefetch", "90px"], ["unacked", "Unacked", "90px"], ["mode", "Mode", "90px"]];
const CHANNEL_NUMERIC = new Set(["connection", "number", "consumers", "prefetch", "unacked"]);

export function mount(view) {
  const error = h("div", { class: "error-box", hidden: true });
  const tbody = h("tbody", { id: "connection-rows" });
  const empty = h("div", { class: "empty", hidden: true }, "No connections.");
  const channelRows = h("tbody", { id: "channel-rows" });
  const noChannels = h("div", { class: "empty", hidden: true }, "No AMQP channels.");
  view.append(h("h1", {}, "Connections"), error,
    h("p", { class: "muted" }, "Native, STOMP and AMQP connections. The console's own HTTP " +
      "requests are short sessions and are not listed."),
    h("div", { class: "table-wrap" }, h("table", {},
      h("colgroup", {}, COLUMNS.map(([, , w]) => h("col", { style: `width:${w}` }))),
      h("thead", {}, h("tr", {}, COLUMNS.map(([k, label]) =>
        h("th", { class: NUMERIC.has(k) ? "num" : "" }, label)))), tbody), empty),
    h("h2", {}, "AMQP channels"),
    h("div", { class: "table-wrap" }, h("table", {},
      h("colgroup", {}, CHANNEL_COLUMNS.map(([, , w]) => h("col", { style: `width:${w}` }))),
      h("thead", {}, h("tr", {}, CHANNEL_COLUMNS.map(([k, label]) =>
        h("th", { class: CHANNEL_NUMERIC.has(k) ? "num" : "" }, label)))), channelRows),
      noChannels));

  async function close(c) {
    await confirmed(`Close connection ${c.id}?`, `The ${c.protocol} connection from ` +
      `${c.address || "?"}${c.user ? ` (user ${c.user})` : ""} is closed; its unacked messages ` +
      "are redelivered and its open transactions roll back.", "Close",
      () => api.closeConnection(c.id), () => `Closed connection ${c.id}.`);
    refresh();
  }

  async function refresh() {
    let found;
    try { found = await api.connections(); } catch (err) {
      error.textContent = err.describe(); error.hidden = false; return;
    }
    error.hidden = true;
    const now = Date.now();
    const shown = found.filter((c) => c.protocol !== "http").sort((a, b) => a.id - b.id);
    syncRows(tbody, shown, (c) => c.id, (c) => h("tr", { dataset: { connection: String(c.id) } },
      COLUMNS.slice(0, -1).map(([k]) => h("td", { class: NUMERIC.has(k) ? "num" : "" })),
      h("td", {}, h("button", { class: "small", onclick: () => close(c) }, "Close…"))),
    (row, c) => {
      const values = [num(c.id), c.protocol, c.user ?? "–", c.address ?? "–",
        duration((now - c.opened_ms) / 1000), num(c.subscriptions), num(c.unacked),
        num(c.transactions), c.xa_branch ?? "–"];
      values.forEach((v, i) => setText(row.cells[i], String(v)));
    });
    empty.hidden = shown.length > 0;
    const channels = shown.flatMap((c) => (c.channels ?? []).map((ch) => ({ connection: c.id, ...ch })));
    syncRows(channelRows, channels, (ch) => `${ch.connection}:${ch.number}`,
      (ch) => h("tr", { dataset: { channel: `${ch.connection}:${ch.number}` } },
        CHANNEL_COLUMNS.map(([k]) => h("td", { class: CHANNEL_NUMERIC.has(k) ? "num" : "" }))),
      (row, ch) => {
        const values = [num(ch.connection), num(ch.number), num(ch.consumers),
          ch.consumer_tags.join(", ") || "–", num(ch.prefetch), num(ch.unacked), ch.mode];
        values.forEach((v, i) => setText(row.cells[i], String(v)));
      });
    noChannels.hidden = channels.length > 0;
  }
  return { stop: poll(refresh, 2000) };
}
