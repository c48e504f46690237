// Readable numbers, sizes and durations; element helpers.

const integer = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
const decimal = new Intl.NumberFormat("en-US", { maximumFractionDigits: 1 });

// 12345 -> "12,345"; null -> "–"
export function num(value) {
  return value === null || value === undefined ? "–" : integer.format(value);
}

// a rate per second: one decimal under 100, none above
export function rate(value) {
  if (value === null || value === undefined || !isFinite(value)) return "–";
  return value < 100 ? decimal.format(value) : integer.format(value);
}

export function bytes(value) {
  if (value === null || value === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let n = value, i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i === 0 ? `${integer.format(n)} B` : `${decimal.format(n)} ${units[i]}`;
}

// seconds -> "3d 4h", "2h 5m", "4m 12s", "9.2s"
export function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.floor(seconds);
  const d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600);
  const m = Math.floor(s % 3600 / 60), r = s % 60;
  if (d) return `${d}d ${h}h`;
  if (h) return `${h}h ${m}m`;
  if (m) return `${m}m ${r}s`;
  return `${decimal.format(seconds)}s`;
}

export function time(ms) {
  return ms ? new Date(ms).toLocaleString("en-GB", { hour12: false }) : "–";
}

// h("td", {class: "num"}, "12") -> <td class="num">12</td>
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key in el && key !== "list" && typeof value !== "string") el[key] = value;
    else el.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

// Set text only when it changed (no needless layout work while polling).
export function setText(el, text) {
  if (el.textContent !== text) el.textContent = text;
}

// Keep a tbody's rows in step with items, by key: existing rows are updated in
// place (buttons in them stay the same elements), new ones made, gone ones removed.
export function syncRows(tbody, items, keyOf, create, update) {
  const existing = new Map();
  for (const row of tbody.rows) existing.set(row.dataset.key, row);
  let previous = null;
  for (const item of items) {
    const key = String(keyOf(item));
    let row = existing.get(key);
    if (row) existing.delete(key);
    else { row = create(item); row.dataset.key = key; }
    update(row, item);
    const wanted = previous ? previous.nextSibling : tbody.firstChild;
    if (wanted !== row) tbody.insertBefore(row, wanted);
    previous = row;
  }
  for (const row of existing.values()) row.remove();
}
