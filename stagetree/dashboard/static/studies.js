// The studies of the storage: one row each, a click opens the study.

import { api } from "./api.js";
import {
  badge, clearBanner, coalesce, esc, firstPaint, fmtInt, fmtNum, fmtRatio, fmtSeconds,
  showBanner, studyHref,
} from "./ui.js";

export class StudiesView {
  constructor(main) {
    this.main = main;
    this.alive = true;
    this.refresh = coalesce(() => this.load());
  }

  async mount() {
    this.main.innerHTML = `
      <section class="page studies-page">
        <h1>Studies</h1>
        <p class="lead">Every study of this storage. Steps <em>requested</em> are what its trials
        ask for, <em>unique</em> what remains once shared prefixes are merged, <em>executed</em>
        what was trained; the saving is (executed + saved) ÷ executed, where saved are the steps the
        finished trials requested beyond those executed (requested ÷ executed once every trial finished).</p>
        <div class="table-wrap"><table class="data studies" id="studies-table">
          <thead><tr>
            <th>Study</th><th>State</th><th class="num">Trials</th>
            <th class="num">done / running / failed</th><th>Best</th>
            <th class="num" title="steps the trials ask for / unique steps of the merged plan / steps trained">Steps requested / unique / executed</th>
            <th class="num">Merge rate</th><th class="num">Device time</th><th class="num">Saving</th>
          </tr></thead>
          <tbody><tr><td colspan="9" class="empty">loading…</td></tr></tbody>
        </table></div>
      </section>`;
    this.main.querySelector("tbody").addEventListener("click", (event) => {
      if (event.target.closest("a")) return;
      const row = event.target.closest("tr[data-study]");
      if (row) row.querySelector("a").click();
    });
    await firstPaint(this);
  }

  async load() {
    let data;
    try {
      data = await api.studies();
      clearBanner("studies");
    } catch (err) {
      showBanner("studies", `Could not load the studies: ${err.message}`);
      return;
    }
    if (!this.alive) return;
    window.stagetree.revision = data.revision;
    document.getElementById("storage-url").textContent = data.url;
    const body = this.main.querySelector("tbody");
    if (!data.studies.length) {
      body.innerHTML = `<tr><td colspan="9" class="empty">No studies in ${esc(data.url)} yet.</td></tr>`;
      return;
    }
    const rows = data.studies.map((s) => {
      const best = s.best === null || s.best === undefined
        ? `<span class="muted">none yet</span>`
        : `<strong>${fmtNum(s.best)}</strong> <span class="muted">${esc(s.metric ?? "")} (${
          s.mode === "min" ? "min" : "max"})</span><div class="sub">trial #${esc(s.best_trial)}${
          s.best_step !== null && s.best_step !== undefined ? ` at step ${fmtInt(s.best_step)}` : ""}</div>`;
      return `<tr data-study="${esc(s.name)}" class="clickable">
        <td><a href="${esc(studyHref(s.name))}" data-link>${esc(s.name)}</a></td>
        <td>${badge(s.state)}</td>
        <td class="num">${fmtInt(s.trials)}</td>
        <td class="num">${fmtInt(s.finished)} / ${fmtInt(s.running)} / ${fmtInt(s.failed)}</td>
        <td class="best">${best}</td>
        <td class="num">${fmtInt(s.steps_requested)} / ${fmtInt(s.steps_unique)} / ${fmtInt(s.steps_executed)}</td>
        <td class="num">${fmtRatio(s.merge_rate)}</td>
        <td class="num">${fmtSeconds(s.device_seconds)}</td>
        <td class="num saving">${fmtRatio(s.saving)}</td>
      </tr>`;
    });
    const t = data.totals || {};
    if (data.studies.length > 1) {
      rows.push(`<tr class="totals"><td>the storage</td><td></td><td></td><td></td><td></td>
        <td class="num">${fmtInt(t.steps_requested)} / ${fmtInt(t.steps_unique)} / ${fmtInt(t.steps_executed)}</td>
        <td class="num">${t.steps_unique ? fmtRatio(t.steps_requested / t.steps_unique) : "—"}</td>
        <td class="num">${fmtSeconds(t.device_seconds)}</td>
        <td class="num">${t.steps_executed ? fmtRatio(t.steps_requested / t.steps_executed) : "—"}</td></tr>`);
    }
    body.innerHTML = rows.join("");
  }

  update() {
    return this.refresh();
  }

  destroy() {
    this.alive = false;
    clearBanner("studies");
  }
}
