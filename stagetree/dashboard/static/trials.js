// The trials table: sortable by any column (click its header).

import { api } from "./api.js";
import {
  badge, clearBanner, coalesce, esc, firstPaint, fmtInt, fmtNum, fmtValue, showBanner, truncate,
} from "./ui.js";

const PAGE = 500;

export class TrialsView {
  constructor(box, name) {
    this.box = box;
    this.name = name;
    this.alive = true;
    this.sort = { key: "id", dir: 1 };
    this.limit = PAGE; // rows drawn (a large table is drawn a page at a time)
    this.data = null;
    this.refresh = coalesce(() => this.load());
  }

  async mount() {
    this.box.innerHTML = `
      <div class="trials-view">
        <div class="toolbar"><span class="counts" id="trial-counts"></span>
          <span class="hint">click a column's header to sort by it; again to reverse</span></div>
        <div class="table-wrap"><table class="data trials" id="trials-table"><thead></thead><tbody>
          <tr><td class="empty">loading…</td></tr></tbody></table></div>
      </div>`;
    this.box.querySelector("thead").addEventListener("click", (event) => {
      const th = event.target.closest("th[data-key]");
      if (!th) return;
      const key = th.dataset.key;
      this.sort = { key, dir: this.sort.key === key ? -this.sort.dir : 1 };
      this.draw();
    });
    this.box.querySelector("tbody").addEventListener("click", (event) => {
      const more = event.target.closest("button[data-more]");
      if (!more) return;
      this.limit = more.dataset.more === "all" ? Infinity : this.limit + PAGE;
      this.draw();
    });
    await firstPaint(this);
  }

  destroy() {
    this.alive = false;
    clearBanner("trials");
  }

  update() {
    return this.refresh();
  }

  async load() {
    let data;
    try {
      data = await api.trials(this.name);
      clearBanner("trials");
    } catch (err) {
      if (err.status !== 404) showBanner("trials", `Could not load the trials: ${err.message}`);
      return;
    }
    if (!this.alive) return;
    this.data = data;
    window.stagetree.revision = data.revision;
    this.draw();
  }

  columns() {
    const d = this.data;
    const metrics = new Set();
    for (const t of d.trials) for (const k of Object.keys(t.metrics || {})) metrics.add(k);
    const names = [...metrics].sort((a, b) => (a === d.metric ? -1 : b === d.metric ? 1 : a.localeCompare(b)));
    return [
      { key: "id", title: "Trial", num: true, value: (t) => t.id },
      { key: "state", title: "State", value: (t) => t.state },
      { key: "steps", title: "Steps", num: true, value: (t) => t.steps },
      ...names.map((m) => ({ key: `m:${m}`, title: m, num: true, metric: m, value: (t) => (t.metrics || {})[m] ?? null })),
      { key: "hp", title: "Sequences", value: (t) => compact(t.hp) },
      { key: "config", title: "Config", value: (t) => compact(t.config) },
      { key: "error", title: "Error", value: (t) => t.error ?? null },
      { key: "checkpoint", title: "Checkpoint", value: (t) => (t.checkpoint ? 1 : 0) },
    ];
  }

  draw() {
    const d = this.data;
    if (!d) return;
    const cols = this.columns();
    const col = cols.find((c) => c.key === this.sort.key) || cols[0];
    const dir = this.sort.dir;
    const rows = d.trials.slice().sort((a, b) => {
      const va = col.value(a);
      const vb = col.value(b);
      if (va === vb) return a.id - b.id;
      if (va === null || va === undefined) return 1; // missing values last either way
      if (vb === null || vb === undefined) return -1;
      if (typeof va === "number" && typeof vb === "number") return dir * (va - vb);
      return dir * String(va).localeCompare(String(vb), undefined, { numeric: true });
    });
    this.box.querySelector("thead").innerHTML = `<tr>${cols.map((c) => {
      const on = c.key === col.key;
      const arrow = on ? (dir > 0 ? " ▲" : " ▼") : "";
      return `<th data-key="${esc(c.key)}" class="sortable${c.num ? " num" : ""}${on ? " sorted" : ""}"
        aria-sort="${on ? (dir > 0 ? "ascending" : "descending") : "none"}"
        title="sort by ${esc(c.title)}">${esc(c.title)}${c.metric === d.metric ? " ★" : ""}${arrow}</th>`;
    }).join("")}</tr>`;
    const body = rows.slice(0, this.limit).map((t) => {
      const cells = cols.map((c) => {
        if (c.key === "id") return `<td class="num">#${esc(t.id)}</td>`;
        if (c.key === "state") return `<td>${badge(t.state)}</td>`;
        if (c.key === "steps") return `<td class="num">${fmtInt(t.steps)}</td>`;
        if (c.metric) return `<td class="num">${fmtNum((t.metrics || {})[c.metric] ?? null)}</td>`;
        if (c.key === "hp" || c.key === "config") {
          const text = compact(c.key === "hp" ? t.hp : t.config);
          return `<td class="code" title="${esc(text)}">${esc(truncate(text, 70))}</td>`;
        }
        if (c.key === "error") {
          return t.error ? `<td class="error" title="${esc(t.error)}">${esc(truncate(t.error, 60))}</td>` : `<td></td>`;
        }
        return t.checkpoint
          ? `<td><a class="download" href="${esc(t.checkpoint)}" download>download</a></td>`
          : `<td></td>`;
      });
      return `<tr data-trial="${esc(t.id)}">${cells.join("")}</tr>`;
    });
    if (rows.length > this.limit) {
      body.push(`<tr class="more-rows"><td colspan="${cols.length}">showing ${fmtInt(this.limit)} of
        ${fmtInt(rows.length)} trials · <button type="button" data-more="page">${fmtInt(Math.min(PAGE, rows.length - this.limit))} more</button>
        <button type="button" data-more="all">all</button></td></tr>`);
    }
    this.box.querySelector("tbody").innerHTML = body.length
      ? body.join("")
      : `<tr><td class="empty" colspan="${cols.length}">No trials yet.</td></tr>`;
    this.box.querySelector("#trial-counts").textContent =
      `${fmtInt(d.trials.length)} trials · sorted by ${col.title} ${dir > 0 ? "ascending" : "descending"}`;
  }
}

function compact(obj) {
  if (!obj || typeof obj !== "object") return obj ?? "";
  return Object.entries(obj).map(([k, v]) => `${k}=${fmtValue(v)}`).join(", ");
}
