// One queue or topic: its numbers (polled every second), its settings (a form
// that sends only what changed), browse without consuming, and the actions:
// purge, delete, move / re-drive (each behind a confirmation).

import { api } from "../api.js";
import { Rates } from "../chart.js";
import { bytes, h, num, rate, setText, time } from "../format.js";
import { confirmed, notify, notifyError, poll } from "../ui.js";

const STATS = [
  ["depth", "Depth"], ["ready", "Ready"], ["scheduled", "Scheduled"], ["in_flight", "In flight"],
  ["consumers", "Consumers"], ["bytes", "Bytes"], ["in_rate", "In / s"], ["out_rate", "Out / s"],
  ["enqueued", "Enqueued"], ["dequeued", "Dequeued"], ["expired", "Expired"],
  ["dead_lettered", "Dead-lettered"],
];

export function mount(view, [name]) {
  const error = h("div", { class: "error-box", id: "queue-error", hidden: true });
  const kindBadge = h("span", { class: "badge", id: "queue-kind-badge" }, "");
  const cards = h("div", { class: "cards" }, STATS.map(([key, label]) =>
    h("div", { class: "card" }, h("div", { class: "label" }, label),
      h("div", { class: "value", id: `q-${key}`, dataset: { field: key } }, "–"))));
  const settingsForm = h("form", { class: "settings", id: "queue-settings" });
  const save = h("button", { class: "primary", id: "settings-save", type: "button",
                             onclick: () => saveSettings() }, "Save settings");
  const origin = h("span", { class: "muted", id: "redrive-origin" }, "");
  const moveTo = h("input", { type: "text", id: "move-to",
                              placeholder: "default: the origin queue", style: "width:220px" });
  const moveLimit = h("input", { type: "number", id: "move-limit", value: "1000", min: "1",
                                 max: "10000", style: "width:100px" });
  const browseLimit = h("input", { type: "number", id: "browse-limit", value: "10", min: "1",
                                   max: "1000", style: "width:90px" });
  const messages = h("div", { id: "messages" },
    h("p", { class: "muted" }, "Browse shows the first messages in delivery order without " +
      "consuming them."));
  view.append(
    h("p", {}, h("a", { href: "#/queues" }, "‹ Queues")),
    h("h1", {}, h("span", { id: "queue-name" }, name), kindBadge),
    error, cards,
    h("div", { class: "grid2" },
      h("div", { class: "panel" }, h("h2", {}, "Actions"),
        h("div", { class: "actions" },
          h("button", { id: "purge", onclick: purge }, "Purge…"),
          h("button", { id: "delete", class: "danger", onclick: remove }, "Delete…")),
        h("h2", { style: "margin-top:18px" }, "Move / re-drive messages"),
        h("p", { class: "muted" }, "Moves ready messages to another queue: from a dead-letter " +
          "or expiry queue, by default back to the queue they came from. ", origin),
        h("div", { class: "toolbar" }, h("label", {}, "to ", moveTo),
          h("label", {}, "at most ", moveLimit),
          h("button", { id: "move", onclick: move }, "Move…"))),
      h("div", { class: "panel" }, h("h2", {}, "Settings"), settingsForm,
        h("div", { class: "actions", style: "margin-top:12px" }, save))),
    h("div", { class: "panel" },
      h("div", { class: "toolbar" }, h("h2", { style: "margin:0" }, "Messages"),
        h("span", { class: "grow" }), h("label", {}, "first ", browseLimit),
        h("button", { id: "browse", class: "primary", onclick: browse }, "Browse")),
      messages));

  let info = null, settingsShown = null;
  const rates = new Rates();

  function showSettings(settings) {
    const inputs = settingsForm.querySelectorAll("input");
    if (settingsShown && inputs.length === Object.keys(settings).length) {
      settingsShown = { ...settings };  // the same form: new values in place
      for (const input of inputs) {
        if (input.type === "checkbox") input.checked = settings[input.name];
        else input.value = String(settings[input.name] ?? "");
      }
      return;
    }
    settingsShown = { ...settings };
    settingsForm.replaceChildren();
    for (const [key, value] of Object.entries(settings)) {
      let input;
      if (typeof value === "boolean") input = h("input", { type: "checkbox", checked: value });
      else if (typeof value === "number") input = h("input", { type: "number", value: String(value) });
      else input = h("input", { type: "text", value: value ?? "" });
      input.name = key;
      input.id = `setting-${key}`;
      settingsForm.append(h("label", { for: input.id }, key), input);
    }
  }

  async function saveSettings() {
    const changed = {};
    for (const input of settingsForm.querySelectorAll("input")) {
      const old = settingsShown[input.name];
      let value;
      if (input.type === "checkbox") value = input.checked;
      else if (input.type === "number") value = input.value === "" ? old : Number(input.value);
      else value = input.value;
      if (value !== old) changed[input.name] = value;
    }
    if (!Object.keys(changed).length) { notify("Nothing changed."); return; }
    try {
      const result = await api.update(name, changed);
      showSettings(result.settings);
      notify(`Saved: ${Object.keys(changed).join(", ")}`);
    } catch (err) { notifyError(err); }
  }

  async function purge() {
    await confirmed(`Purge ${name}?`, "Ready and scheduled messages are dropped for good. " +
      "Messages in flight stay with their consumers.", "Purge",
      () => api.purge(name), (r) => `Purged ${num(r.purged)} message(s) from ${name}.`);
    refresh();
  }

  async function remove() {
    const done = await confirmed(`Delete ${name}?`, `The ${info?.kind || "queue"} and its ` +
      `${num(info?.messages ?? info?.depth ?? 0)} message(s) are deleted for good.`, "Delete",
      () => api.remove(name), (r) => `Deleted ${name} (${num(r.deleted)} message(s)).`);
    if (done) location.hash = "#/queues";
  }

  async function move() {
    const to = moveTo.value.trim();
    const limit = Number(moveLimit.value || 1000);
    const args = { limit };
    if (to) args.to = to;
    await confirmed(`Move messages from ${name}?`, `Up to ${num(limit)} ready message(s) ` +
      `move to ${to || "the queue they were dead-lettered or expired from"}.`, "Move",
      () => api.move(name, args), (r) => `Moved ${num(r.moved)} message(s) to ${r.to}.`);
    refresh();
  }

  async function browse() {
    let found;
    try { found = await api.browse(name, Number(browseLimit.value || 10)); } catch (err) {
      notifyError(err); return;
    }
    messages.replaceChildren();
    if (!found.length) {
      messages.append(h("div", { class: "empty", id: "no-messages" }, "No messages."));
      return;
    }
    for (const m of found) messages.append(messageView(m));
    messages.scrollIntoView({ block: "nearest" });
  }

  async function refresh() {
    try { info = await api.queue(name); } catch (err) {
      error.textContent = err.describe(); error.hidden = false; return;
    }
    error.hidden = true;
    setText(kindBadge, info.kind);
    const now = rates.update({ in_rate: info.enqueued ?? 0, out_rate: info.dequeued ?? 0 });
    for (const [key] of STATS) {
      const el = document.getElementById(`q-${key}`);
      if (key === "in_rate" || key === "out_rate") setText(el, now ? rate(now[key]) : "–");
      else if (key === "bytes") setText(el, bytes(info[key]));
      else setText(el, num(info[key]));
    }
    if (settingsShown === null && info.settings) showSettings(info.settings);
  }

  const stop = poll(refresh, 1000);
  findOrigin();
  return { stop };

  async function findOrigin() {
    try {
      const all = await api.queues();
      const from = all.filter((q) => q.settings && (q.settings.dead_letter_queue === name ||
                                                    q.settings.expiry_queue === name));
      if (from.length) {
        setText(origin, `This is the dead-letter or expiry queue of ${from.map((q) => q.name).join(", ")}.`);
      }
    } catch { /* optional */ }
  }
}

function messageView(m) {
  const raw = m.body_encoding === "base64" ? base64Bytes(m.body) : new TextEncoder().encode(m.body);
  const body = h("pre", { class: "body", dataset: { seq: String(m.seq) } },
    m.body_encoding === "text" ? m.body : hexDump(raw));
  const asText = h("button", { class: "small", disabled: m.body_encoding !== "text",
    onclick: () => { body.textContent = m.body; } }, "text");
  const asHex = h("button", { class: "small", onclick: () => { body.textContent = hexDump(raw); } },
    "hex");
  const headers = Object.keys(m.headers || {}).length
    ? h("pre", { class: "headers" }, JSON.stringify(m.headers, null, 2)) : null;
  return h("div", { class: "message", dataset: { id: String(m.id) } },
    h("div", { class: "meta" },
      h("span", {}, "seq ", h("b", {}, num(m.seq))),
      m.message_id ? h("span", {}, "id ", h("b", { class: "mono" }, m.message_id)) : null,
      h("span", {}, "priority ", h("b", {}, m.priority)),
      h("span", {}, "state ", h("b", {}, m.state)),
      h("span", {}, "deliveries ", h("b", {}, num(m.delivery_count))),
      h("span", {}, "size ", h("b", {}, bytes(m.size))),
      h("span", {}, h("b", {}, time(m.timestamp_ms))),
      h("span", { class: "grow" }), h("span", {}, "body as ", asText, " ", asHex)),
    headers ? h("div", { class: "caption" }, "headers") : null, headers,
    h("div", { class: "caption" }, "body"), body);
}

function base64Bytes(text) {
  const binary = atob(text);
  const out = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) out[i] = binary.charCodeAt(i);
  return out;
}

// 16 bytes a line: offset, hex, printable ASCII
export function hexDump(data) {
  const lines = [];
  for (let offset = 0; offset < data.length; offset += 16) {
    const chunk = data.slice(offset, offset + 16);
    const hex = Array.from(chunk, (b) => b.toString(16).padStart(2, "0")).join(" ");
    const ascii = Array.from(chunk, (b) => (b >= 32 && b < 127 ? String.fromCharCode(b) : "."))
      .join("");
    lines.push(`${offset.toString(16).padStart(8, "0")}  ${hex.padEnd(47)}  ${ascii}`);
  }
  return lines.join("\n") || "(empty)";
}
