// A small line chart on <canvas>: a fixed number of points per series, drawn
// again on each push; the y axis grows to the largest visible value.

export class LineChart {
  constructor(canvas, series, { points = 120 } = {}) {
    this.canvas = canvas;
    this.series = series;          // [{label, color}]
    this.points = points;
    this.data = series.map(() => []);
  }

  push(values) {
    values.forEach((value, i) => {
      const column = this.data[i];
      column.push(value);
      if (column.length > this.points) column.shift();
    });
    this.canvas.dataset.points = String(this.data[0].length);  // for tests
    this.draw();
  }

  draw() {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth, height = canvas.clientHeight;
    if (!width || !height) return;
    if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
    if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
    const g = canvas.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, width, height);
    const left = 52, right = 8, top = 8, bottom = 18;
    const plotW = width - left - right, plotH = height - top - bottom;
    let max = 0;
    for (const column of this.data) for (const v of column) if (v > max) max = v;
    const scale = niceMax(max);
    g.font = "11px system-ui, sans-serif";
    g.fillStyle = "#69738a";
    g.strokeStyle = "#e8ebf0";
    g.lineWidth = 1;
    g.textAlign = "right";
    g.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {
      const y = top + plotH - (plotH * i) / 4;
      g.beginPath(); g.moveTo(left, Math.round(y) + 0.5); g.lineTo(left + plotW, Math.round(y) + 0.5);
      g.stroke();
      g.fillText(label(scale * i / 4), left - 6, y);
    }
    g.textAlign = "left";
    g.fillText(`${this.points} s`, left, height - 6);
    g.textAlign = "right";
    g.fillText("now", left + plotW, height - 6);
    const step = plotW / (this.points - 1);
    this.data.forEach((column, s) => {
      if (column.length < 2) return;
      g.strokeStyle = this.series[s].color;
      g.lineWidth = 1.8;
      g.beginPath();
      const offset = this.points - column.length;
      column.forEach((v, i) => {
        const x = left + (offset + i) * step;
        const y = top + plotH - (plotH * v) / scale;
        if (i === 0) g.moveTo(x, y); else g.lineTo(x, y);
      });
      g.stroke();
    });
  }
}

// 0 -> 1, 7 -> 10, 130 -> 200, 4200 -> 5000
function niceMax(value) {
  if (value <= 0) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const m of [1, 2, 5, 10]) if (value <= m * power) return m * power;
  return 10 * power;
}

function label(value) {
  if (value >= 1e6) return `${+(value / 1e6).toFixed(1)}M`;
  if (value >= 1e3) return `${+(value / 1e3).toFixed(1)}k`;
  return `${+value.toFixed(2)}`;
}

// Per-second rates from successive counter readings (a restart resets to null).
export class Rates {
  constructor() { this.last = null; }
  // counters: {name: total}; returns {name: per second} or null on the first reading
  update(counters, now = performance.now()) {
    const last = this.last;
    this.last = { counters, now };
    if (!last) return null;
    const seconds = (now - last.now) / 1000;
    if (seconds <= 0) return null;
    const result = {};
    for (const [name, value] of Object.entries(counters)) {
      const delta = value - (last.counters[name] ?? value);
      result[name] = delta >= 0 ? delta / seconds : 0;
    }
    return result;
  }
}
