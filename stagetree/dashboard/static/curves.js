// Learning curves: metric vs step for every trial, from the per-node segments.
//
// A trial's curve runs through its path of nodes: on each node, the points after the
// previous node's last step up to the trial's last step on this node (`ends`; without
// it, the next node's branch step from the tree, or the trial's steps on its last node). A point shared by several shown trials is drawn
// once, in grey, thicker the more trials share it; each trial's own part after the branch
// is one `path.curve[data-trial]`, coloured by its final value. A trial whose whole curve
// is shared gets a thin overlay, so every shown trial has exactly one `.curve`.

import { api } from "./api.js";
import { TreeData } from "./store.js";
import {
  clearBanner, coalesce, esc, firstPaint, fmtInt, fmtNum, hideTooltip, showBanner, showTooltip,
} from "./ui.js";

const d3 = window.d3;
const M = { top: 18, right: 140, bottom: 44, left: 64 };

export class CurvesView {
  constructor(box, name) {
    this.box = box;
    this.name = name;
    this.alive = true;
    this.metric = null;
    this.data = null;
    this.tree = new TreeData(name);
    this.states = null; // shown states (null: all)
    this.rungs = null; // shown rungs (null: all)
    this.refresh = coalesce(() => this.load());
  }

  async mount() {
    this.box.innerHTML = `
      <div class="curves-view">
        <div class="toolbar">
          <label>metric <select id="curve-metric"></select></label>
          <span class="filter" id="curve-states"></span>
          <span class="filter" id="curve-rungs"></span>
          <span class="counts" id="curve-counts"></span>
        </div>
        <div class="legend" id="curve-legend"></div>
        <div class="chart-box"><svg class="curves-svg"></svg></div>
      </div>`;
    this.svg = this.box.querySelector(".curves-svg");
    this.box.querySelector("#curve-metric").addEventListener("change", (e) => {
      this.metric = e.target.value;
      this.refresh();
    });
    this.box.addEventListener("change", (e) => {
      const input = e.target.closest("input[data-filter]");
      if (!input) return;
      const group = input.dataset.filter;
      const checked = [...this.box.querySelectorAll(`input[data-filter="${group}"]:checked`)].map((i) => i.value);
      this[group] = new Set(checked);
      this.draw();
    });
    this.svg.addEventListener("mouseover", (e) => this.hover(e));
    this.svg.addEventListener("mousemove", (e) => this.hover(e));
    this.svg.addEventListener("mouseout", () => this.unhover());
    this.onResize = () => this.draw();
    window.addEventListener("resize", this.onResize);
    await firstPaint(this);
  }

  destroy() {
    this.alive = false;
    window.removeEventListener("resize", this.onResize);
    hideTooltip();
    clearBanner("curves");
  }

  update(info) {
    if (info && info.reset) this.tree.revision = null;
    return this.refresh();
  }

  async load() {
    let data;
    try {
      data = await api.curves(this.name, this.metric ?? undefined);
      // without each trial's `ends`, the nodes' branch steps come from the tree
      if (data.trials.some((t) => !Array.isArray(t.ends))) await this.tree.sync();
      clearBanner("curves");
    } catch (err) {
      if (err.status !== 404) showBanner("curves", `Could not load the learning curves: ${err.message}`);
      return;
    }
    if (!this.alive) return;
    this.data = data;
    this.metric = data.metric;
    window.stagetree.revision = data.revision;
    this.controls();
    this.draw();
  }

  controls() {
    const d = this.data;
    const sel = this.box.querySelector("#curve-metric");
    const metrics = d.metrics && d.metrics.length ? d.metrics : d.metric ? [d.metric] : [];
    const opts = metrics.map((m) => `<option value="${esc(m)}"${m === d.metric ? " selected" : ""}>${esc(m)}</option>`).join("");
    if (sel.innerHTML !== opts) sel.innerHTML = opts;
    const counts = (key) => {
      const c = new Map();
      for (const t of d.trials) c.set(String(t[key] ?? "none"), (c.get(String(t[key] ?? "none")) || 0) + 1);
      return c;
    };
    const boxes = (group, label, c, sortNum) => {
      const keys = [...c.keys()].sort(sortNum ? (a, b) => Number(a) - Number(b) : undefined);
      if (keys.length < 2 && !this[group]) return "";
      return `<span class="filter-label">${label}</span>` + keys.map((k) => {
        const on = !this[group] || this[group].has(k);
        return `<label class="check"><input type="checkbox" data-filter="${group}" value="${esc(k)}"${on ? " checked" : ""}>${esc(k)} <span class="muted">(${c.get(k)})</span></label>`;
      }).join("");
    };
    this.box.querySelector("#curve-states").innerHTML = boxes("states", "state", counts("state"), false);
    this.box.querySelector("#curve-rungs").innerHTML = boxes("rungs", "rung", counts("rung"), true);
  }

  // The curve of every shown trial, and how many shown trials share each point.
  build() {
    const d = this.data;
    const seg = d.segments || {};
    const nodes = this.tree.nodes;
    const shown = d.trials.filter((t) =>
      (!this.states || this.states.has(String(t.state ?? "none"))) &&
      (!this.rungs || this.rungs.has(String(t.rung ?? "none"))));
    // reaches[node] = the last step of that node each shown trial uses
    const reaches = new Map();
    const plan = shown.map((t) => {
      const path = t.nodes || [];
      const ends = Array.isArray(t.ends) && t.ends.length === path.length ? t.ends : null;
      const parts = path.map((id, i) => {
        // the steps of node i on this trial's path: after the previous node's last step,
        // up to its own (`ends`, or the next node's branch step from the tree)
        let start;
        let reach;
        if (ends) {
          start = i === 0 ? -Infinity : ends[i - 1];
          reach = ends[i];
        } else {
          const node = nodes.get(id);
          start = i === 0 ? -Infinity : node ? node.start : -Infinity;
          const next = i + 1 < path.length ? nodes.get(path[i + 1]) : null;
          reach = i + 1 < path.length ? (next ? next.start : Infinity) : t.steps ?? Infinity;
          if (i + 1 < path.length && !next) {
            // the next node is not known yet (tree behind the curves): up to its first point
            const pts = seg[String(path[i + 1])];
            reach = pts && pts.length ? pts[0][0] - 1 : t.steps ?? Infinity;
          }
        }
        let list = reaches.get(id);
        if (!list) reaches.set(id, (list = []));
        list.push(reach);
        return { id, start, reach };
      });
      return { t, parts };
    });
    for (const list of reaches.values()) list.sort((a, b) => a - b);
    const countAt = (id, step) => {
      const list = reaches.get(id);
      return list.length - d3.bisectLeft(list, step); // reaches >= step
    };
    const curves = plan.map(({ t, parts }) => {
      const pts = [];
      for (const { id, start, reach } of parts) {
        for (const p of seg[String(id)] || []) {
          if (p[0] > start && p[0] <= reach && p[1] !== null && p[1] !== undefined) {
            pts.push({ s: p[0], v: p[1], node: id, n: countAt(id, p[0]) });
          }
        }
      }
      return { t, pts };
    });
    return curves;
  }

  draw() {
    if (!this.data || !this.alive) return;
    const d = this.data;
    const curves = this.build();
    this.curves = new Map(curves.map((c) => [c.t.id, c]));
    const finals = curves.filter((c) => c.pts.length).map((c) => c.pts[c.pts.length - 1].v);
    const [flo, fhi] = finals.length ? d3.extent(finals) : [0, 1];
    const failed = curves.some((c) => c.t.state === "failed");
    const noPoints = curves.filter((c) => !c.pts.length).length;
    const lo4 = d3.format(".4~g")(d.mode === "min" ? fhi : flo);
    const hi4 = d3.format(".4~g")(d.mode === "min" ? flo : fhi);
    this.box.querySelector("#curve-legend").innerHTML = `
      <span class="key"><span class="ramp"></span>trial's own part, by final value: ${esc(lo4)} (worse) → ${esc(hi4)} (better)</span>
      <span class="key"><span class="sw line shared-key"></span>shared prefix, drawn once (thicker: more trials)</span>
      <span class="key"><span class="sw line best-key"></span>best trial</span>
      ${failed ? `<span class="key"><span class="sw line failed-key"></span>failed (dashed)</span>` : ""}`;

    const W = Math.max(500, this.box.querySelector(".chart-box").clientWidth);
    const top = this.svg.getBoundingClientRect().top;
    const H = Math.max(300, Math.min(620, window.innerHeight - top - 16));
    this.svg.setAttribute("width", W);
    this.svg.setAttribute("height", H);
    const all = curves.flatMap((c) => c.pts);
    const maxStep = Math.max(1, d3.max(all, (p) => p.s) ?? 1, d3.max(curves, (c) => c.t.steps ?? 0) ?? 1);
    let [lo, hi] = d3.extent(all, (p) => p.v);
    if (lo === undefined) [lo, hi] = [0, 1];
    if (lo === hi) [lo, hi] = [lo - 0.5, hi + 0.5];
    const x = d3.scaleLinear().domain([0, maxStep]).range([M.left, W - M.right]);
    const y = d3.scaleLinear().domain([lo, hi]).nice().range([H - M.bottom, M.top]);
    const better = d.mode === "min" ? (v) => (fhi === flo ? 1 : (fhi - v) / (fhi - flo)) : (v) => (fhi === flo ? 1 : (v - flo) / (fhi - flo));
    const colour = (v) => d3.interpolateViridis(0.05 + 0.78 * better(v));
    const line = (pts) => pts.length ? `M${pts.map((p) => `${x(p.s).toFixed(1)},${y(p.v).toFixed(1)}`).join("L")}` : "";

    // shared points: runs of equal share count on one node, drawn once
    const shared = new Map(); // "node|count|runstart" -> pts
    const done = new Set();
    for (const c of curves) {
      let prev = null;
      let run = null;
      for (const p of c.pts) {
        if (p.n >= 2) {
          const key = `${p.node}|${p.s}`;
          if (!done.has(key)) {
            done.add(key);
            if (!run || run.n !== p.n || run.node !== p.node) {
              run = { n: p.n, node: p.node, pts: prev ? [prev] : [] };
              shared.set(`${p.node}|${p.s}`, run);
            }
            run.pts.push(p);
          } else {
            run = null;
          }
        }
        prev = p;
      }
    }
    // thicker the more trials share it, relative to the most shared (the root)
    const most = Math.max(2, ...[...shared.values()].map((r) => r.n));
    const width = (n) => 1.2 + 5 * Math.sqrt(n / most);
    const sharedPaths = [...shared.values()].filter((r) => r.pts.length > 1).map((r) =>
      `<path class="shared" data-count="${r.n}" stroke-width="${width(r.n).toFixed(2)}" d="${line(r.pts)}"/>`);

    // each trial's own part (from the point before it leaves the shared part)
    const own = curves.map((c) => {
      const i = c.pts.findIndex((p) => p.n < 2);
      const cls = `curve st-${esc(c.t.state)}`;
      const stroke = c.pts.length ? colour(c.pts[c.pts.length - 1].v) : "#999";
      if (c.pts.length === 1) {
        // a trial stopped after its first evaluation: a dot, or it would not show
        const p = c.pts[0];
        return `<path class="${cls}" data-trial="${c.t.id}" stroke="${stroke}" d="M${x(p.s)},${y(p.v)}h0"/>` +
          `<circle class="curve-dot" cx="${x(p.s)}" cy="${y(p.v)}" r="3.5" fill="${stroke}"/>`;
      }
      if (i < 0) {
        return `<path class="${cls} covered" data-trial="${c.t.id}" stroke="${stroke}" d="${line(c.pts)}"/>`;
      }
      const part = c.pts.slice(Math.max(0, i - 1));
      return `<path class="${cls}" data-trial="${c.t.id}" stroke="${stroke}" d="${line(part.length > 1 ? part : c.pts)}"/>`;
    });

    // the best trial, marked and labelled
    let best = "";
    const bc = this.curves.get(d.best_trial);
    if (bc && bc.pts.length) {
      const last = bc.pts[bc.pts.length - 1];
      const lx = x(last.s);
      const ly = y(last.v);
      const text = `best #${d.best_trial}: ${fmtNum(last.v)}`;
      const fits = lx + 10 + text.length * 7.4 < W - 4;
      const ty = fits ? ly + 4 : ly < M.top + 30 ? ly + 20 : ly - 12;
      best = `<path class="best" d="${line(bc.pts)}"/><circle class="best-dot" cx="${lx}" cy="${ly}" r="4.5"/>` +
        `<text class="best-label" x="${fits ? lx + 9 : lx - 4}" y="${ty}" text-anchor="${fits ? "start" : "end"}">${esc(text)}</text>`;
    }

    this.svg.innerHTML = `<g class="x-axis" transform="translate(0,${H - M.bottom})"></g>
      <g class="y-axis" transform="translate(${M.left},0)"></g>
      <text class="axis-title" x="${(M.left + W - M.right) / 2}" y="${H - 8}" text-anchor="middle">training step</text>
      <text class="axis-title" transform="translate(16,${(M.top + H - M.bottom) / 2}) rotate(-90)" text-anchor="middle">${esc(d.metric ?? "")}${d.mode ? ` (${d.mode === "min" ? "lower" : "higher"} is better)` : ""}</text>
      <g class="plot">${sharedPaths.join("")}${own.join("")}${best}<path class="hl"/></g>`;
    d3.select(this.svg).select(".x-axis").call(d3.axisBottom(x).ticks(Math.max(2, Math.floor((W - M.left - M.right) / 90))).tickFormat(d3.format(",~r")));
    d3.select(this.svg).select(".y-axis").call(d3.axisLeft(y).ticks(Math.max(3, Math.floor(H / 60))).tickSize(-(W - M.left - M.right)));
    this.x = x;
    this.y = y;
    this.line = line;
    this.box.querySelector("#curve-counts").textContent =
      `${fmtInt(curves.length)} of ${fmtInt(d.trials.length)} trials shown` +
      (noPoints ? ` · ${fmtInt(noPoints)} without points yet` : "") +
      ` · ${fmtInt(sharedPaths.length)} shared segments`;

  }

  hover(event) {
    const path = event.target.closest("path.curve, path.shared, path.best");
    if (!path) return this.unhover();
    const hl = this.svg.querySelector("path.hl");
    if (path.classList.contains("shared")) {
      hl.setAttribute("d", "");
      showTooltip(`shared prefix of <strong>${esc(path.dataset.count)}</strong> shown trials`, event);
      return;
    }
    const id = path.classList.contains("best") ? this.data.best_trial : Number(path.dataset.trial);
    const c = this.curves.get(id);
    if (!c) return;
    hl.setAttribute("d", this.line(c.pts));
    const last = c.pts[c.pts.length - 1];
    const t = c.t;
    showTooltip(`<strong>trial #${esc(t.id)}</strong> · ${esc(t.state)}<br>
      ${fmtInt(t.steps)} steps · rung ${esc(t.rung ?? "—")}<br>
      ${last ? `${esc(this.data.metric)} ${fmtNum(last.v)} at step ${fmtInt(last.s)}` : "no points yet"}<br>
      <span class="muted">nodes ${(t.nodes || []).map((n) => `#${n}`).join(" → ")}</span>`, event);
  }

  unhover() {
    const hl = this.svg.querySelector("path.hl");
    if (hl) hl.setAttribute("d", "");
    hideTooltip();
  }
}
