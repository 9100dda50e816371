// The workers timeline: a Gantt chart, one lane per worker, one bar per batch from its
// start to its end (or now, while it runs); the checkpoint load is the hatched start of a
// bar (a batch that starts a fresh model, at step 0, loads nothing: its start, building
// the trainer, is pale instead), checkpoint saves are marks above it; a grey lane shows through where the worker
// was idle. Wheel zooms the time axis, drag pans.

import { api } from "./api.js";
import {
  BATCH_COLOURS, clearBanner, coalesce, esc, firstPaint, fitText, fmtClock, fmtInt, fmtSeconds,
  hideTooltip, showBanner, showTooltip, textWidth, uiFont,
} from "./ui.js";

const d3 = window.d3;
const LANE = 34;
const BAR = 20;
const M = { top: 16, right: 20, bottom: 40, left: 150 }; // left: fitted to the lane labels

export class TimelineView {
  constructor(box, name) {
    this.box = box;
    this.name = name;
    this.alive = true;
    this.batches = new Map();
    this.workers = [];
    this.seq = null;
    this.now = null; // the server's clock at the last answer, and ours then
    this.kx = 1;
    this.tx = 0;
    this.refresh = coalesce(() => this.load());
  }

  async mount() {
    const legend = Object.entries(BATCH_COLOURS).map(([s, c]) =>
      `<span class="key"><span class="sw" style="background:${c}"></span>${s}</span>`).join("");
    this.box.innerHTML = `
      <div class="timeline-view">
        <div class="toolbar">
          <div class="legend">${legend}
            <span class="key"><span class="sw hatch"></span>loading a checkpoint</span>
            <span class="key"><span class="sw build"></span>building a fresh trainer</span>
            <span class="key"><span class="save-key">▼</span>checkpoint saved</span>
            <span class="key"><span class="sw idle"></span>idle</span>
          </div>
          <div class="tools">
            <span class="counts" id="tl-counts"></span>
            <button type="button" data-act="zoom-in">+</button>
            <button type="button" data-act="zoom-out">−</button>
            <button type="button" data-act="fit">fit</button>
          </div>
        </div>
        <div class="hint">wheel: zoom time · drag: pan · double-click: fit · hover a bar for its stages and
          trials · checkpoint saves show on bars wide enough (zoom in)</div>
        <div class="chart-box"><svg class="timeline-svg"></svg></div>
        <h3>Workers</h3>
        <div class="table-wrap"><table class="data workers" id="workers-table"><thead><tr>
          <th>Worker</th><th>Where</th><th class="num">Batches</th><th class="num">Busy</th>
          <th class="num">Idle</th><th>Busy share</th></tr></thead><tbody></tbody></table></div>
      </div>`;
    this.svg = this.box.querySelector(".timeline-svg");
    this.bind();
    if (!(await firstPaint(this))) return;
    this.ticker = setInterval(() => {
      if ([...this.batches.values()].some((b) => b.state === "running")) this.draw();
    }, 1000);
  }

  destroy() {
    this.alive = false;
    clearInterval(this.ticker);
    window.removeEventListener("resize", this.onResize);
    hideTooltip();
    clearBanner("timeline");
  }

  update(info) {
    if (info && info.reset) {
      this.seq = null; // every batch again
      this.batches.clear();
    }
    return this.refresh();
  }

  async load() {
    let data;
    try {
      data = await api.timeline(this.name, this.seq ?? undefined);
      clearBanner("timeline");
    } catch (err) {
      if (err.status !== 404) showBanner("timeline", `Could not load the workers timeline: ${err.message}`);
      return;
    }
    if (!this.alive) return;
    for (const b of data.batches) this.batches.set(b.key, b);
    this.workers = data.workers || this.workers;
    this.seq = data.seq;
    this.now = { server: data.now, local: Date.now() / 1000 };
    window.stagetree.revision = data.revision;
    this.draw();
  }

  clock() {
    if (!this.now) return Date.now() / 1000;
    return this.now.server + (Date.now() / 1000 - this.now.local);
  }

  bind() {
    this.onResize = () => this.draw();
    window.addEventListener("resize", this.onResize);
    const plotW = () => this.width - M.left - M.right;
    const zoomAt = (factor, px) => {
      const k = Math.max(1, Math.min(5000, this.kx * factor));
      const p = px - M.left;
      this.tx = p - ((p - this.tx) * k) / this.kx;
      this.kx = k;
      this.clamp();
      this.draw();
    };
    this.svg.addEventListener("wheel", (event) => {
      event.preventDefault();
      const rect = this.svg.getBoundingClientRect();
      zoomAt(Math.exp(-event.deltaY * (event.deltaMode ? 0.05 : 0.002)), event.clientX - rect.left);
    }, { passive: false });
    let drag = null;
    this.svg.addEventListener("pointerdown", (event) => {
      drag = { x: event.clientX, tx: this.tx };
      this.svg.setPointerCapture(event.pointerId);
    });
    this.svg.addEventListener("pointermove", (event) => {
      if (drag) {
        this.tx = drag.tx + event.clientX - drag.x;
        this.clamp();
        this.draw();
        return;
      }
      this.hover(event);
    });
    this.svg.addEventListener("pointerup", () => (drag = null));
    this.svg.addEventListener("mouseleave", () => hideTooltip());
    this.svg.addEventListener("dblclick", () => {
      this.kx = 1;
      this.tx = 0;
      this.draw();
    });
    for (const b of this.box.querySelectorAll(".tools button")) {
      b.addEventListener("click", () => {
        const act = b.dataset.act;
        if (act === "fit") {
          this.kx = 1;
          this.tx = 0;
          this.draw();
        } else zoomAt(act === "zoom-in" ? 2 : 0.5, M.left + plotW() / 2);
      });
    }
  }

  clamp() {
    const w = this.width - M.left - M.right;
    this.tx = Math.min(0, Math.max(w - w * this.kx, this.tx));
  }

  draw() {
    if (!this.alive) return;
    const batches = [...this.batches.values()];
    const now = this.clock();
    const names = new Set(this.workers.map((w) => String(w.worker)));
    for (const b of batches) names.add(String(b.worker));
    const lanes = [...names].sort((a, b) => a.localeCompare(b, undefined, { numeric: true }));
    const laneFont = uiFont(12.5, 600);
    const barFont = uiFont(11, 600);
    M.left = Math.min(260, Math.max(90, ...lanes.map((l) => textWidth(`worker ${l}`, laneFont) + 20)));
    this.width = Math.max(500, this.box.querySelector(".chart-box").clientWidth);
    const W = this.width;
    const H = M.top + Math.max(1, lanes.length) * LANE + M.bottom;
    this.svg.setAttribute("width", W);
    this.svg.setAttribute("height", H);
    const counts = this.box.querySelector("#tl-counts");
    if (!batches.length) {
      this.svg.innerHTML = `<text class="empty" x="${M.left}" y="${M.top + 20}">Nothing has been trained for this study yet.</text>`;
      counts.textContent = "";
      this.drawWorkers(lanes, batches);
      return;
    }
    const end = (b) => b.ended ?? Math.max(now, b.started);
    let t0 = d3.min(batches, (b) => b.started);
    let t1 = d3.max(batches, end);
    const pad = Math.max(0.01, (t1 - t0) * 0.02);
    t0 -= pad;
    t1 += pad;
    const w = W - M.left - M.right;
    const base = (t) => ((t - t0) / (t1 - t0)) * w;
    const x = (t) => M.left + base(t) * this.kx + this.tx;
    const lo = M.left - 20;
    const hi = W + 20;
    const cx = (t) => Math.max(lo, Math.min(hi, x(t)));
    const laneY = new Map(lanes.map((l, i) => [l, M.top + i * LANE]));
    const out = [];
    for (const l of lanes) {
      const y = laneY.get(l);
      out.push(`<rect class="lane" x="${cx(t0 + pad)}" y="${y + (LANE - BAR) / 2}" width="${Math.max(0, cx(t1 - pad) - cx(t0 + pad))}" height="${BAR}"/>`);
      out.push(`<text class="lane-label" x="${M.left - 10}" y="${y + LANE / 2 + 4}" text-anchor="end">${esc(fitText(`worker ${l}`, M.left - 14, laneFont))}</text>`);
    }
    batches.sort((a, b) => a.started - b.started);
    for (const b of batches) {
      const y = laneY.get(String(b.worker)) + (LANE - BAR) / 2;
      if (x(end(b)) < M.left - 2 || x(b.started) > W) continue; // outside the zoomed window
      const xa = cx(b.started);
      const xb = Math.max(cx(end(b)), xa + 1.5);
      const xl = Math.min(xb, cx(b.started + (b.load_seconds || 0)));
      // thin bars (zoomed out) go without their outline and marks: zoom in to see them
      const wide = xb - xa >= 6;
      let g = `<g class="batch" data-batch="${esc(b.key)}" data-state="${esc(b.state)}" data-start="${esc(b.start_step)}">` +
        `<rect class="bar${wide ? "" : " thin"}" x="${xa.toFixed(1)}" y="${y}" width="${(xb - xa).toFixed(1)}" height="${BAR}" fill="${BATCH_COLOURS[b.state] || "#888"}"/>`;
      if (xl - xa >= 1) g += `<rect class="${fresh(b) ? "build" : "load"}" x="${xa.toFixed(1)}" y="${y}" width="${(xl - xa).toFixed(1)}" height="${BAR}"/>`;
      if (wide) {
        for (const [t] of b.saves || []) {
          const xs = cx(t).toFixed(1);
          g += `<path class="save" d="M${xs} ${y + BAR}V${y}M${xs} ${y}l-4 -6h8z"/>`;
        }
      }
      const label = merged(b.segments).map(([n, a, z]) => `#${n} ${a}→${z}`).join(", ");
      const room = Math.min(xb, W - M.right) - Math.max(xl, M.left) - 8;
      if (room > 30) {
        const text = fitText(label, room, barFont);
        if (text) g += `<text class="bar-label" x="${(Math.max(xl, M.left) + 4).toFixed(1)}" y="${y + BAR / 2 + 4}">${esc(text)}</text>`;
      }
      out.push(`${g}</g>`);
    }
    // a "now" line while something runs
    if (batches.some((b) => b.state === "running")) {
      const xn = cx(now).toFixed(1);
      out.push(`<line class="now" x1="${xn}" x2="${xn}" y1="${M.top - 6}" y2="${H - M.bottom}"/><text class="now-label" x="${xn}" y="${M.top - 8}" text-anchor="middle">now</text>`);
    }
    this.svg.innerHTML = `<defs><clipPath id="tl-clip"><rect x="${M.left}" y="0" width="${w + M.right}" height="${H}"/></clipPath>
      <pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">
      <rect width="6" height="6" fill="#fff" fill-opacity="0.35"/><line x1="0" y1="0" x2="0" y2="6" stroke="#000" stroke-opacity="0.45" stroke-width="2"/></pattern></defs>
      <g class="x-axis" transform="translate(0,${H - M.bottom + 4})"></g>
      <g class="labels">${out.filter((s) => s.startsWith("<text class=\"lane-label")).join("")}</g>
      <g clip-path="url(#tl-clip)">${out.filter((s) => !s.startsWith("<text class=\"lane-label")).join("")}</g>
      <text class="axis-title" x="${M.left + w / 2}" y="${H - 4}" text-anchor="middle"></text>`;
    // the axis: seconds since the first batch started (clock time in the title)
    const origin = t0 + pad;
    const v0 = t0 + (-this.tx / (w * this.kx)) * (t1 - t0) - origin;
    const v1 = v0 + (t1 - t0) / this.kx;
    const scale = d3.scaleLinear().domain([v0, v1]).range([M.left, M.left + w]);
    const ticks = scale.ticks(Math.max(2, Math.floor(w / 100)));
    const decimals = ticks.length > 1 ? d3.precisionFixed(ticks[1] - ticks[0]) : 0;
    d3.select(this.svg).select(".x-axis")
      .call(d3.axisBottom(scale).tickValues(ticks).tickFormat((v) => fmtElapsed(v, v1 - v0, decimals)));
    this.svg.querySelector(".axis-title").textContent =
      `time since the first batch started, at ${fmtClock(origin)}`;
    const running = batches.filter((b) => b.state === "running").length;
    counts.textContent = `${fmtInt(batches.length)} batches on ${lanes.length} worker${lanes.length === 1 ? "" : "s"}` +
      (running ? ` · ${running} running` : "") + ` · ${fmtSeconds(t1 - t0 - 2 * pad)} in all`;
    this.drawWorkers(lanes, batches);
  }

  drawWorkers(lanes, batches) {
    const byWorker = new Map(this.workers.map((w) => [String(w.worker), w]));
    const where = new Map();
    const nb = new Map();
    for (const b of batches) {
      where.set(String(b.worker), b.location);
      nb.set(String(b.worker), (nb.get(String(b.worker)) || 0) + 1);
    }
    this.box.querySelector("#workers-table tbody").innerHTML = lanes.map((l) => {
      const w = byWorker.get(l) || {};
      const busy = w.busy_seconds ?? null;
      const idle = w.idle_seconds ?? null;
      const share = busy !== null && idle !== null && busy + idle > 0 ? busy / (busy + idle) : null;
      return `<tr data-worker="${esc(l)}"><td>worker ${esc(l)}</td><td class="code">${esc(where.get(l) ?? "")}</td>
        <td class="num">${fmtInt(nb.get(l) || 0)}</td><td class="num">${fmtSeconds(busy)}</td>
        <td class="num">${fmtSeconds(idle)}</td>
        <td>${share === null ? "—" : `<span class="share"><span style="width:${(100 * share).toFixed(1)}%"></span></span> ${Math.round(100 * share)}%`}</td></tr>`;
    }).join("") || `<tr><td class="empty" colspan="6">No workers yet.</td></tr>`;
  }

  hover(event) {
    const g = event.target.closest("g.batch");
    if (!g) return hideTooltip();
    const b = this.batches.get(g.dataset.batch);
    if (!b) return hideTooltip();
    const segs = merged(b.segments).map(([n, a, z]) => `node #${esc(n)}: steps ${fmtInt(a)}–${fmtInt(z)}`).join("<br>");
    const trials = (b.trials || []);
    const dur = (b.ended ?? this.clock()) - b.started;
    const fused = (b.fused || 1) > 1 ? ` · fused with ${fmtInt(b.fused - 1)} sibling${b.fused === 2 ? "" : "s"}` : "";
    showTooltip(`<strong>batch ${esc(b.key)}</strong> · ${esc(b.state)}${fused}<br>
      worker ${esc(b.worker)} <span class="muted">${esc(b.location ?? "")}</span><br>${segs}<br>
      trials ${trials.slice(0, 20).map((t) => `#${esc(t)}`).join(", ")}${trials.length > 20 ? ` … (${trials.length})` : ""}<br>
      ${fmtClock(b.started)} → ${b.ended ? fmtClock(b.ended) : "running"} (${fmtSeconds(dur)})<br>
      ${fresh(b) ? "fresh trainer built in" : "checkpoint load"} ${fmtSeconds(b.load_seconds)} · busy ${fmtSeconds(b.busy_seconds)} · ${(b.saves || []).length} checkpoint save${(b.saves || []).length === 1 ? "" : "s"}`, event);
  }
}

// A batch from step 0 starts a fresh model: its start time built the trainer, it loaded
// no checkpoint (a batch from a later step loads one, or continues a model in memory).
function fresh(b) {
  return (b.start_step || 0) === 0;
}

function fmtElapsed(v, span, decimals) {
  const sign = v < 0 ? "−" : "";
  const a = Math.abs(v);
  if (span < 120) return `${sign}${d3.format(`,.${decimals}f`)(a)} s`;
  const h = Math.floor(a / 3600);
  const m = Math.floor((a % 3600) / 60);
  const sec = Math.round(a % 60);
  const pad2 = (n) => String(n).padStart(2, "0");
  return h ? `${sign}${h}:${pad2(m)}:${pad2(sec)}` : `${sign}${m}:${pad2(sec)}`;
}

// [node, from, to) segments with the contiguous pieces of one node joined
function merged(segments) {
  const out = [];
  for (const [n, a, z] of segments || []) {
    const last = out[out.length - 1];
    if (last && last[0] === n && last[2] === a) last[2] = z;
    else out.push([n, a, z]);
  }
  return out;
}
