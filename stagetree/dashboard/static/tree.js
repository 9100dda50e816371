// The stage tree of a study, live.
//
// One row per plan node, in depth-first order (children by branch step); x is the
// training step. A node is a bar from `start` to `end`: solid up to `done` (trained),
// lighter after; a connector drops from the parent's row at the child's `start`.
// Checkpoints are diamonds. Subtrees are collapsed past ~LIMIT rows (a "+N" pill; click
// to expand). Rows are drawn as SVG strings (fast for thousands of rows); hovering and
// clicking are resolved from the pointer's row, not per-element listeners.

import { api } from "./api.js";
import { TreeData } from "./store.js";
import {
  STATE_COLOURS, clearBanner, coalesce, esc, firstPaint, fitText, fmtInt, fmtNum, fmtValue,
  showBanner, textWidth, truncate, uiFont,
} from "./ui.js";

const d3 = window.d3;

const ROW = 18; // px per row
const BAR = 10; // bar height
const LIMIT = 1500; // rows drawn before subtrees are collapsed
const CHUNK = 500; // children shown per click on "more"
const LABEL_W = 260; // the label column
const PAD_R = 18;
const AXIS_H = 34;

export class TreeView {
  constructor(box, name) {
    this.box = box;
    this.name = name;
    this.alive = true;
    this.nodes = new Map();
    this.roots = [];
    this.maxStep = 1;
    this.data = new TreeData(name);
    this.rows = [];
    this.rowOf = new Map(); // node id -> row index
    this.expanded = new Set(); // expanded by the user (beyond the limit)
    this.collapsed = new Set(); // collapsed by the user
    this.more = new Map(); // parent id (or "forest") -> children shown
    this.kx = 1;
    this.tx = 0;
    this.details = new Map(); // node id -> promise of /nodes/{id}
    this.pinned = null;
    this.shown = null; // node id in the panel
    this.frame = 0;
    this.refresh = coalesce(() => this.load());
  }

  // ---------------------------------------------------------------- set-up
  async mount() {
    const legend = Object.entries(STATE_COLOURS).map(([s, c]) =>
      `<span class="key"><span class="sw" style="background:${c}"></span>${s}</span>`).join("");
    this.box.innerHTML = `
      <div class="tree-view">
        <div class="toolbar">
          <div class="legend">${legend}
            <span class="key"><span class="sw split"></span>solid: trained · light: still to train</span>
            <span class="key"><span class="dash-key"></span>announced branches only (nothing requested)</span>
            <span class="key"><span class="diamond"></span>checkpoint</span>
            <span class="key"><span class="sw faded"></span>only other studies' trials</span>
            <span class="key"><span class="pill-key">+N</span>collapsed subtree</span>
          </div>
          <div class="tools">
            <span class="counts" id="tree-counts"></span>
            <button type="button" data-act="zoom-in" title="zoom in on steps">+</button>
            <button type="button" data-act="zoom-out" title="zoom out">−</button>
            <button type="button" data-act="fit" title="show all steps">fit</button>
            <button type="button" data-act="reset" title="collapse and expand as at first">reset layout</button>
          </div>
        </div>
        <div class="hint">wheel: scroll · ctrl+wheel, or wheel over the axis: zoom steps ·
          drag: pan · click a node to pin its details · ▸/▾ or +N: expand/collapse</div>
        <div class="tree-body">
          <div class="tree-main">
            <svg class="tree-axis" height="${AXIS_H}"></svg>
            <div class="tree-scroll" tabindex="0">
              <svg class="tree-svg">
                <defs>
                  <clipPath id="tree-plot-clip"><rect class="clip-plot"></rect></clipPath>
                  <clipPath id="tree-label-clip"><rect class="clip-label"></rect></clipPath>
                </defs>
                <g class="grid"></g>
                <rect class="band hover-band" height="${ROW}" visibility="hidden"></rect>
                <rect class="band pin-band" height="${ROW}" visibility="hidden"></rect>
                <g clip-path="url(#tree-plot-clip)"><path class="links"></path><g class="bars"></g></g>
                <line class="label-sep"></line>
                <g class="labels" clip-path="url(#tree-label-clip)"></g>
              </svg>
            </div>
          </div>
          <aside class="node-panel" id="node-panel">
            <p class="muted">Hover a node to see its sequences and metrics; click to pin it.</p>
          </aside>
        </div>
      </div>`;
    this.scroll = this.box.querySelector(".tree-scroll");
    this.svg = this.box.querySelector(".tree-svg");
    this.axis = this.box.querySelector(".tree-axis");
    this.panel = this.box.querySelector("#node-panel");
    this.bindEvents();
    this.resize();
    await firstPaint(this);
  }

  destroy() {
    this.alive = false;
    window.removeEventListener("resize", this.onResize);
    window.removeEventListener("keydown", this.onKey);
    cancelAnimationFrame(this.frame);
    clearBanner("tree");
  }

  update(info) {
    if (info && info.reset) this.data.revision = null; // a full tree again
    return this.refresh();
  }

  // ---------------------------------------------------------------- data
  async load() {
    let change;
    try {
      change = await this.data.sync();
      clearBanner("tree");
    } catch (err) {
      if (err.status !== 404) showBanner("tree", `Could not load the stage tree: ${err.message}`);
      return;
    }
    if (!this.alive) return;
    if (change.full) this.details.clear();
    for (const id of change.changed) this.details.delete(id);
    for (const id of change.removed) this.details.delete(id);
    this.nodes = this.data.nodes;
    this.roots = this.data.roots;
    this.maxStep = this.data.maxStep;
    window.stagetree.tree.nodes = this.nodes;
    window.stagetree.revision = this.data.revision;
    const same = !change.full && !change.changed.length && !change.removed.length;
    if (same && this.rows.length) return; // a revision that changed nothing of this tree
    this.relayout();
    if (this.shown !== null && (change.full || change.changed.includes(this.shown))) {
      this.showNode(this.shown, true);
    }
  }

  detail(id) {
    let p = this.details.get(id);
    if (!p) {
      p = api.node(this.name, id).catch((err) => {
        this.details.delete(id);
        throw err;
      });
      this.details.set(id, p);
    }
    return p;
  }

  // ---------------------------------------------------------------- layout
  layout() {
    const kids = new Map();
    const forest = [];
    for (const n of this.nodes.values()) {
      if (n.parent === null || n.parent === undefined || !this.nodes.has(n.parent)) forest.push(n);
      else {
        let list = kids.get(n.parent);
        if (!list) kids.set(n.parent, (list = []));
        list.push(n);
      }
    }
    forest.sort((a, b) => a.root - b.root || a.start - b.start || a.id - b.id);
    for (const list of kids.values()) list.sort((a, b) => a.start - b.start || a.id - b.id);

    // subtree sizes, children before parents
    const order = [];
    const stack = forest.slice();
    while (stack.length) {
      const n = stack.pop();
      order.push(n);
      const c = kids.get(n.id);
      if (c) for (const k of c) stack.push(k);
    }
    const size = new Map();
    for (let i = order.length - 1; i >= 0; i--) {
      const n = order[i];
      let s = 1;
      const c = kids.get(n.id);
      if (c) for (const k of c) s += size.get(k.id);
      size.set(n.id, s);
    }

    // which nodes show their children: the user's choices first, then breadth-first while
    // the rows fit in LIMIT (so the top of a large tree shows, its big subtrees folded)
    const forestShown = Math.min(forest.length, this.more.get("forest") ?? LIMIT);
    let budget = LIMIT - forestShown;
    const shownKids = new Map();
    const queue = forest.slice(0, forestShown);
    for (let qi = 0; qi < queue.length; qi++) {
      const n = queue[qi];
      const c = kids.get(n.id);
      if (!c) continue;
      let show = 0;
      if (this.collapsed.has(n.id)) show = 0;
      else if (this.expanded.has(n.id)) show = Math.min(c.length, Math.max(this.more.get(n.id) ?? 0, CHUNK));
      else if (c.length <= budget) show = c.length;
      budget -= show;
      shownKids.set(n.id, show);
      for (let i = 0; i < show; i++) queue.push(c[i]);
    }

    // depth-first rows
    const rows = [];
    const st = [];
    if (forest.length > forestShown) st.push({ more: "forest", count: forest.length - forestShown, prow: -1 });
    for (let i = forestShown - 1; i >= 0; i--) st.push({ n: forest[i], prow: -1 });
    let collapsedCount = 0;
    while (st.length) {
      const item = st.pop();
      if (item.more !== undefined) {
        rows.push(item);
        continue;
      }
      const r = rows.length;
      const c = kids.get(item.n.id);
      const show = shownKids.get(item.n.id) || 0;
      const hidden = c && show === 0 ? size.get(item.n.id) - 1 : 0;
      if (hidden) collapsedCount++;
      rows.push({ n: item.n, prow: item.prow, kids: c ? c.length : 0, show, hidden });
      if (c && show > 0 && show < c.length) st.push({ more: item.n.id, count: c.length - show, prow: r });
      for (let i = show - 1; i >= 0; i--) st.push({ n: c[i], prow: r });
    }
    this.rows = rows;
    this.rowOf = new Map();
    rows.forEach((row, i) => row.n && this.rowOf.set(row.n.id, i));
    this.kids = kids;
    this.collapsedCount = collapsedCount;
  }

  // ---------------------------------------------------------------- drawing
  relayout() {
    this.layout();
    this.resize();
    this.render();
  }

  resize() {
    const top = this.scroll.getBoundingClientRect().top;
    const room = Math.max(260, window.innerHeight - top - 16);
    const h = Math.min(room, Math.max(120, this.rows.length * ROW + 8));
    this.scroll.style.height = `${h}px`;
    this.width = Math.max(400, this.scroll.clientWidth);
    this.plotW = this.width - LABEL_W - PAD_R;
  }

  scale() {
    // the visible steps, from the zoom (kx) and pan (tx, in px)
    const w = this.plotW;
    const s0 = (-this.tx / (w * this.kx)) * this.maxStep;
    const s1 = ((w - this.tx) / (w * this.kx)) * this.maxStep;
    return d3.scaleLinear().domain([s0, s1]).range([LABEL_W, LABEL_W + w]);
  }

  render() {
    const rows = this.rows;
    const height = rows.length * ROW + 6;
    const W = this.width;
    this.svg.setAttribute("width", W);
    this.svg.setAttribute("height", height);
    const clipP = this.svg.querySelector(".clip-plot");
    clipP.setAttribute("x", LABEL_W);
    clipP.setAttribute("y", 0);
    clipP.setAttribute("width", this.plotW + PAD_R);
    clipP.setAttribute("height", height);
    const clipL = this.svg.querySelector(".clip-label");
    clipL.setAttribute("x", 0);
    clipL.setAttribute("y", 0);
    clipL.setAttribute("width", LABEL_W - 4);
    clipL.setAttribute("height", height);
    const sep = this.svg.querySelector(".label-sep");
    sep.setAttribute("x1", LABEL_W - 0.5);
    sep.setAttribute("x2", LABEL_W - 0.5);
    sep.setAttribute("y2", height);
    for (const band of this.svg.querySelectorAll(".band")) band.setAttribute("width", W);
    this.renderLabels();
    this.renderPlot();
    this.placeBand(".pin-band", this.pinned);
    const drawn = rows.reduce((k, r) => k + (r.n ? 1 : 0), 0);
    window.stagetree.rendered = drawn;
    const counts = this.box.querySelector("#tree-counts");
    counts.textContent = `${fmtInt(this.nodes.size)} nodes · ${fmtInt(drawn)} drawn` +
      (this.collapsedCount ? ` · ${fmtInt(this.collapsedCount)} collapsed subtrees` : "") +
      (this.roots.length > 1 ? ` · ${this.roots.length} trees` : "");
    if (!this.nodes.size) {
      this.svg.querySelector(".labels").innerHTML =
        `<text class="empty" x="12" y="18">This study has no plan nodes yet.</text>`;
    }
  }

  renderLabels() {
    const out = [];
    const rows = this.rows;
    const font = uiFont(11.5);
    const bold = uiFont(11.5, 600);
    const pillFont = uiFont(10.5, 600);
    let widest = 0;
    for (const row of rows) if (row.n) widest = Math.max(widest, String(row.n.id).length);
    const lx = 20 + textWidth(`#${"8".repeat(widest)}`, bold) + 7; // labels after the widest id
    for (let i = 0; i < rows.length; i++) {
      const row = rows[i];
      const y = i * ROW;
      if (row.more !== undefined) {
        out.push(`<g class="more" data-more="${row.more}" transform="translate(0,${y})">` +
          `<text x="20" y="13">… ${fmtInt(row.count)} more ${row.more === "forest" ? "trees" : "branches"} (click to show)</text></g>`);
        continue;
      }
      const n = row.n;
      const cls = n.trials && n.trials.length ? "" : n.others ? " other" : "";
      const idText = `#${n.id}`;
      let right = W_RIGHT;
      let pills = "";
      if (row.hidden) {
        const t = `+${fmtInt(row.hidden)}`;
        const w = textWidth(t, pillFont) + 12;
        pills += `<g class="pill collapsed" data-expand="${n.id}"><rect x="${right - w}" y="2" width="${w}" height="${ROW - 4}" rx="7"/>` +
          `<text x="${right - w / 2}" y="13" text-anchor="middle">${t}</text></g>`;
        right -= w + 4;
      }
      // the state in words where colour alone would carry it
      let note = null;
      if (n.state === "training") note = `⚙ ${truncate(n.worker ?? "", 14)}`;
      else if (n.state === "failed" || n.state === "cancelled") note = n.state;
      if (note) {
        pills += `<text class="note st-${n.state}" x="${right}" y="13" text-anchor="end">${esc(note)}</text>`;
        right -= textWidth(note, bold) + 6;
      }
      const label = fitText(n.label || "", right - lx, font);
      const tog = row.kids ? `<text class="tog" x="5" y="13">${row.show ? "▾" : "▸"}</text>` : "";
      out.push(`<g class="lab${cls}" data-node="${n.id}" transform="translate(0,${y})">${tog}` +
        `<text class="nid" x="20" y="13">${idText}</text>` +
        (label ? `<text class="ltxt" x="${lx.toFixed(1)}" y="13">${esc(label)}</text>` : "") +
        `${pills}</g>`);
    }
    this.svg.querySelector(".labels").innerHTML = out.join("");
  }

  renderPlot() {
    const x = this.scale();
    const rows = this.rows;
    const [s0, s1] = x.domain();
    const lo = LABEL_W - 50;
    const hi = LABEL_W + this.plotW + 50;
    const cx = (s) => Math.max(lo, Math.min(hi, x(s))); // keep coordinates small when zoomed
    const height = rows.length * ROW + 6;
    const bars = [];
    let links = "";
    const y0 = (ROW - BAR) / 2;
    for (let i = 0; i < rows.length; i++) {
      const row = rows[i];
      if (!row.n) continue;
      const n = row.n;
      const y = i * ROW;
      const xa = cx(n.start);
      const xb = Math.max(cx(n.end), xa + 2);
      const xd = cx(Math.max(n.start, Math.min(n.done ?? n.start, n.end)));
      // past what any request wants, the bar only carries announced (declared) branches
      const xw = Math.max(xd, cx(Math.min(n.wanted ?? n.end, n.end)));
      const cls = n.trials && n.trials.length ? "node own" : n.others ? "node other" : "node";
      let ck = "";
      for (const c of n.checkpoints || []) {
        if (c < s0 - 1 || c > s1 + 1) continue;
        const cxp = x(c).toFixed(1);
        ck += `M${cxp} ${ROW / 2 - 5}l4 5l-4 5l-4 -5z`;
      }
      bars.push(`<g class="${cls}" data-node="${n.id}" data-state="${n.state}" transform="translate(0,${y})">` +
        (xw > xa ? `<rect class="rest" x="${xa.toFixed(1)}" y="${y0}" width="${(xw - xa).toFixed(1)}" height="${BAR}"/>` : "") +
        (xb > xw + 1 ? `<path class="declared" d="M${xw.toFixed(1)} ${ROW / 2}H${xb.toFixed(1)}"/>` : "") +
        (xw <= xa && xb <= xw + 1 ? `<rect class="rest" x="${xa.toFixed(1)}" y="${y0}" width="2" height="${BAR}"/>` : "") +
        (xd > xa ? `<rect class="done" x="${xa.toFixed(1)}" y="${y0}" width="${(xd - xa).toFixed(1)}" height="${BAR}"/>` : "") +
        (ck ? `<path class="ckpt" d="${ck}"/>` : "") + `</g>`);
      if (row.prow >= 0) {
        const xs = xa.toFixed(1);
        links += `M${xs} ${row.prow * ROW + ROW / 2 + BAR / 2}V${y + ROW / 2}`;
      }
    }
    this.svg.querySelector(".bars").innerHTML = bars.join("");
    this.svg.querySelector(".links").setAttribute("d", links);

    // the grid and the axis
    const ticks = x.ticks(Math.max(2, Math.floor(this.plotW / 90))).filter(Number.isInteger);
    this.svg.querySelector(".grid").innerHTML = ticks.map((t) => {
      const xp = x(t).toFixed(1);
      return `<line x1="${xp}" x2="${xp}" y1="0" y2="${height}"/>`;
    }).join("");
    this.axis.setAttribute("width", this.width);
    const ax = d3.select(this.axis);
    ax.selectAll("*").remove();
    ax.append("g").attr("class", "axis").attr("transform", `translate(0,${AXIS_H - 1})`)
      .call(d3.axisTop(x).tickValues(ticks).tickFormat(d3.format(",d")).tickSizeOuter(0));
    ax.append("text").attr("class", "axis-title").attr("x", 8).attr("y", AXIS_H - 10)
      .text(`training step${this.kx > 1.001 ? ` (zoomed ×${d3.format(".2~r")(this.kx)})` : ""}`);
  }

  schedulePlot() {
    if (this.frame) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = 0;
      if (this.alive) this.renderPlot();
    });
  }

  placeBand(sel, id) {
    const band = this.svg.querySelector(sel);
    const r = id === null || id === undefined ? undefined : this.rowOf.get(id);
    if (r === undefined) {
      band.setAttribute("visibility", "hidden");
      return;
    }
    band.setAttribute("y", r * ROW);
    band.setAttribute("visibility", "visible");
  }

  // ---------------------------------------------------------------- zoom, pan, pointer
  zoomAt(factor, px) {
    const kMax = Math.max(1, this.maxStep / 3);
    const k = Math.max(1, Math.min(kMax, this.kx * factor));
    const p = px - LABEL_W;
    this.tx = p - ((p - this.tx) * k) / this.kx;
    this.kx = k;
    this.clampPan();
    this.schedulePlot();
  }

  clampPan() {
    this.tx = Math.min(0, Math.max(this.plotW - this.plotW * this.kx, this.tx));
  }

  rowAt(event) {
    const rect = this.svg.getBoundingClientRect();
    const y = event.clientY - rect.top;
    const i = Math.floor(y / ROW);
    return { i, row: i >= 0 && i < this.rows.length ? this.rows[i] : null, x: event.clientX - rect.left };
  }

  bindEvents() {
    this.onResize = () => {
      this.resize();
      this.clampPan();
      this.render();
    };
    window.addEventListener("resize", this.onResize);
    this.onKey = (event) => {
      if (event.key === "Escape" && this.pinned !== null) this.unpin();
    };
    window.addEventListener("keydown", this.onKey);

    const wheel = (event, zoom) => {
      if (zoom || event.ctrlKey || event.metaKey) {
        event.preventDefault();
        const rect = this.svg.getBoundingClientRect();
        this.zoomAt(Math.exp(-event.deltaY * (event.deltaMode ? 0.05 : 0.002)), event.clientX - rect.left);
      } else if (event.shiftKey || Math.abs(event.deltaX) > Math.abs(event.deltaY)) {
        event.preventDefault();
        this.tx -= event.shiftKey ? event.deltaY : event.deltaX;
        this.clampPan();
        this.schedulePlot();
      }
    };
    this.scroll.addEventListener("wheel", (e) => wheel(e, false), { passive: false });
    this.axis.addEventListener("wheel", (e) => wheel(e, true), { passive: false });

    // drag to pan (x: steps, y: scroll); a drag is not a click
    let drag = null;
    this.scroll.addEventListener("pointerdown", (event) => {
      if (event.button !== 0) return;
      drag = { x: event.clientX, y: event.clientY, tx: this.tx, top: this.scroll.scrollTop, moved: false };
    });
    window.addEventListener("pointermove", (event) => {
      if (!drag || !this.alive) return;
      const dx = event.clientX - drag.x;
      const dy = event.clientY - drag.y;
      if (!drag.moved && Math.abs(dx) + Math.abs(dy) < 4) return;
      drag.moved = true;
      this.scroll.classList.add("dragging");
      this.tx = drag.tx + dx;
      this.clampPan();
      this.scroll.scrollTop = drag.top - dy;
      this.schedulePlot();
    });
    window.addEventListener("pointerup", () => {
      if (!drag) return;
      this.dragged = drag.moved;
      drag = null;
      this.scroll.classList.remove("dragging");
    });
    this.scroll.addEventListener("dblclick", (event) => {
      if (event.target.closest(".lab, .more")) return;
      this.kx = 1;
      this.tx = 0;
      this.schedulePlot();
    });

    this.scroll.addEventListener("mousemove", (event) => {
      if (drag && drag.moved) return;
      const { i, row } = this.rowAt(event);
      const band = this.svg.querySelector(".hover-band");
      if (!row) {
        band.setAttribute("visibility", "hidden");
        return;
      }
      band.setAttribute("y", i * ROW);
      band.setAttribute("visibility", "visible");
      if (row.n && this.pinned === null && this.shown !== row.n.id) this.showNode(row.n.id);
    });
    this.scroll.addEventListener("mouseleave", () => {
      this.svg.querySelector(".hover-band").setAttribute("visibility", "hidden");
    });
    this.scroll.addEventListener("click", (event) => {
      if (this.dragged) {
        this.dragged = false;
        return;
      }
      const { row, x } = this.rowAt(event);
      if (!row) return;
      if (row.more !== undefined) return this.showMore(row.more);
      const n = row.n;
      if (event.target.closest(".pill.collapsed")) return this.toggle(n.id, row, true);
      if (row.kids && x < 18) return this.toggle(n.id, row);
      if (this.pinned === n.id) return this.unpin();
      this.pinned = n.id;
      this.placeBand(".pin-band", n.id);
      this.showNode(n.id);
    });

    for (const b of this.box.querySelectorAll(".tools button")) {
      b.addEventListener("click", () => {
        const act = b.dataset.act;
        const mid = LABEL_W + this.plotW / 2;
        if (act === "zoom-in") this.zoomAt(2, mid);
        if (act === "zoom-out") this.zoomAt(0.5, mid);
        if (act === "fit") {
          this.kx = 1;
          this.tx = 0;
          this.schedulePlot();
        }
        if (act === "reset") {
          this.expanded.clear();
          this.collapsed.clear();
          this.more.clear();
          this.relayout();
        }
      });
    }
  }

  toggle(id, row, open = false) {
    if (row.show && !open) {
      this.collapsed.add(id);
      this.expanded.delete(id);
    } else {
      this.collapsed.delete(id);
      this.expanded.add(id);
    }
    this.relayout();
  }

  showMore(parent) {
    const kids = parent === "forest" ? null : this.kids.get(parent);
    const current = parent === "forest" ? (this.more.get("forest") ?? LIMIT) : (this.more.get(parent) ?? CHUNK);
    this.more.set(parent, current + CHUNK);
    if (kids) this.expanded.add(parent);
    this.relayout();
  }

  unpin() {
    this.pinned = null;
    this.placeBand(".pin-band", null);
    this.panel.classList.remove("pinned");
  }

  // ---------------------------------------------------------------- the side panel
  async showNode(id, refresh = false) {
    const n = this.nodes.get(id);
    if (!n) return;
    this.shown = id;
    this.panel.classList.toggle("pinned", this.pinned === id);
    if (!refresh || !this.panel.querySelector(".np-head")) {
      this.panel.innerHTML = this.panelHead(n) + `<div class="np-detail muted">loading…</div>`;
    }
    let detail;
    try {
      detail = await this.detail(id);
    } catch (err) {
      if (this.shown === id) {
        const box = this.panel.querySelector(".np-detail");
        if (box) box.textContent = `Could not load node #${id}: ${err.message}`;
      }
      return;
    }
    if (this.shown !== id || !this.alive) return;
    this.panel.innerHTML = this.panelHead(detail.node || n) + this.panelDetail(detail.node || n, detail);
  }

  panelHead(n) {
    const trials = n.trials || [];
    const list = trials.slice(0, 24).map((t) => `#${esc(t)}`).join(", ");
    return `<div class="np-head">
        <h2>Node #${esc(n.id)} <span class="badge st-${esc(n.state)}">${esc(n.state)}</span>
          ${this.pinned === n.id ? `<span class="pin-note">pinned · Esc to release</span>` : ""}</h2>
        <div class="np-label">${esc(n.label || "")}</div>
        <dl class="np-facts">
          <dt>steps</dt><dd>${fmtInt(n.start)} → ${fmtInt(n.end)} (trained to ${fmtInt(n.done)})</dd>
          ${n.state === "training" ? `<dt>worker</dt><dd>${esc(n.worker ?? "?")}</dd>` : ""}
          <dt>parent</dt><dd>${n.parent === null || n.parent === undefined ? "— (root)" : `#${esc(n.parent)}`}</dd>
          <dt>checkpoints</dt><dd>${(n.checkpoints || []).length ? n.checkpoints.map(fmtInt).join(", ") : "none"}</dd>
          <dt>trials</dt><dd>${trials.length ? `${list}${trials.length > 24 ? ` … (${fmtInt(trials.length)} in all)` : ""}` : "none of this study"}</dd>
          ${n.others ? `<dt>other studies</dt><dd>${fmtInt(n.others)} trial${n.others === 1 ? "" : "s"}</dd>` : ""}
        </dl>
      </div>`;
  }

  panelDetail(n, detail) {
    const parts = [];
    const hp = detail.hp || {};
    const names = Object.keys(hp);
    parts.push(`<h3>Sequences over steps ${fmtInt(n.start)}–${fmtInt(n.end)}</h3>`);
    if (!names.length) parts.push(`<p class="muted">no sequential hyper-parameters</p>`);
    for (const name of names) {
      const runs = hp[name];
      const text = runs.slice(0, 6).map(([a, b, v]) =>
        `<li><span class="hp-steps">${fmtInt(a)}–${fmtInt(b)}</span> <span class="hp-val">${esc(fmtValue(v))}</span></li>`).join("");
      parts.push(`<div class="hp" data-hp="${esc(name)}"><div class="hp-name">${esc(name)}</div>
        ${sparkStep(runs, n.start, n.end)}
        <ul class="hp-runs">${text}${runs.length > 6 ? `<li class="muted">… ${runs.length - 6} more changes</li>` : ""}</ul></div>`);
    }
    const metrics = detail.metrics || [];
    parts.push(`<h3>Metrics reached</h3>`);
    if (!metrics.length) {
      parts.push(`<p class="muted">none yet</p>`);
    } else {
      const keys = [...new Set(metrics.flatMap(([, m]) => Object.keys(m)))].slice(0, 4);
      const pick = sample(metrics, 8);
      parts.push(`<table class="mini"><thead><tr><th>step</th>${keys.map((k) => `<th>${esc(k)}</th>`).join("")}</tr></thead><tbody>` +
        pick.map(([s, m], i) => `<tr${i === pick.length - 1 ? ` class="last"` : ""}><td>${fmtInt(s)}</td>${keys.map((k) => `<td>${fmtNum(m[k])}</td>`).join("")}</tr>`).join("") +
        `</tbody></table>`);
    }
    const tr = detail.trials || [];
    if (tr.length) {
      parts.push(`<h3>Trials through this node</h3><div class="np-trials">` +
        tr.slice(0, 40).map((t) => `<span class="chip st-${esc(t.state)}" title="${esc(t.state)}, ${fmtInt(t.steps)} steps">#${esc(t.id)} · ${fmtInt(t.steps)}</span>`).join("") +
        (tr.length > 40 ? `<span class="muted">… ${fmtInt(tr.length - 40)} more</span>` : "") + `</div>`);
    }
    return `<div class="np-detail">${parts.join("")}</div>`;
  }
}

const W_RIGHT = LABEL_W - 8;

function sample(list, k) {
  if (list.length <= k) return list;
  const out = [];
  for (let i = 0; i < k; i++) out.push(list[Math.round((i * (list.length - 1)) / (k - 1))]);
  return out;
}

// A small step chart of one sequence's runs [from, to, value) over [start, end).
function sparkStep(runs, start, end) {
  const values = runs.map((r) => r[2]).filter((v) => typeof v === "number" && Number.isFinite(v));
  if (values.length !== runs.length || !runs.length) return "";
  const W = 280;
  const H = 56;
  const L = 44;
  const x = d3.scaleLinear().domain([start, Math.max(end, start + 1)]).range([L, W - 6]);
  const [vlo, vhi] = d3.extent(values);
  let [lo, hi] = [vlo, vhi];
  const log = lo > 0 && hi / lo > 20;
  if (lo === hi) {
    lo = lo === 0 ? -1 : lo * (log ? 0.5 : 0.9);
    hi = hi === 0 ? 1 : hi * (log ? 2 : 1.1);
    if (lo > hi) [lo, hi] = [hi, lo];
  }
  const y = (log ? d3.scaleLog() : d3.scaleLinear()).domain([lo, hi]).range([H - 8, 6]);
  let d = "";
  runs.forEach(([a, b, v], i) => {
    d += `${i ? "V" : `M${x(a).toFixed(1)} `}${y(v).toFixed(1)}H${x(b).toFixed(1)}`;
  });
  const fmt = d3.format(".3~g");
  return `<svg class="spark" width="${W}" height="${H}" role="img">
    <line class="base" x1="${L}" x2="${W - 6}" y1="${H - 4}" y2="${H - 4}"/>
    <text x="${L - 4}" y="${y(vhi) + 4}" text-anchor="end">${fmt(vhi)}</text>
    ${vlo !== vhi ? `<text x="${L - 4}" y="${y(vlo) + 4}" text-anchor="end">${fmt(vlo)}</text>` : ""}
    <path d="${d}"/></svg>`;
}
