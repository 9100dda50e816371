// One study: its summary and savings panel (always shown) and four tabs.

import { api } from "./api.js";
import { CurvesView } from "./curves.js";
import { TimelineView } from "./timeline.js";
import { TreeView } from "./tree.js";
import { TrialsView } from "./trials.js";
import {
  badge, clearBanner, coalesce, esc, fmtInt, fmtNum, fmtRatio, fmtSeconds, showBanner, studyHref,
} from "./ui.js";

export const VIEWS = ["tree", "curves", "trials", "workers"];
const TITLES = { tree: "Stage tree", curves: "Learning curves", trials: "Trials", workers: "Workers" };
const CLASSES = { tree: TreeView, curves: CurvesView, trials: TrialsView, workers: TimelineView };

export class StudyPage {
  constructor(main, name, view) {
    this.main = main;
    this.name = name;
    this.view = VIEWS.includes(view) ? view : "tree";
    this.child = null;
    this.alive = true;
    this.missing = false;
    this.refresh = coalesce(() => this.loadSummary());
  }

  async mount() {
    const tabs = VIEWS.map((v) => `<a class="tab" data-link data-tab="${v}"
      href="${esc(studyHref(this.name, v))}">${TITLES[v]}</a>`).join("");
    this.main.innerHTML = `
      <section class="page study-page">
        <div class="study-head">
          <div class="study-title"><h1>${esc(this.name)}</h1><span id="study-state"></span>
            <div class="study-facts" id="study-facts"></div></div>
          <div class="savings" id="savings"><div class="muted">loading…</div></div>
        </div>
        <nav class="tabs" role="tablist">${tabs}</nav>
        <div class="view" id="view"></div>
      </section>`;
    // the view's data first: on a large study the summary is the slower read
    await this.show(this.view);
    await this.loadSummary();
  }

  async show(view) {
    if (this.missing) return;
    this.view = view;
    for (const a of this.main.querySelectorAll(".tab")) {
      a.classList.toggle("active", a.dataset.tab === view);
      a.setAttribute("aria-selected", a.dataset.tab === view ? "true" : "false");
    }
    if (this.child) this.child.destroy();
    const box = this.main.querySelector("#view");
    box.innerHTML = "";
    box.className = `view view-${view}`;
    this.child = new CLASSES[view](box, this.name);
    await this.child.mount();
  }

  async loadSummary() {
    let data;
    try {
      data = await api.study(this.name);
      clearBanner("study");
    } catch (err) {
      if (err.status === 404) return this.notFound(err.message);
      showBanner("study", `Could not load study ${this.name}: ${err.message}`);
      return;
    }
    if (!this.alive) return;
    this.renderSummary(data.study);
    this.renderSavings(data.savings, data.study);
    // the views below size themselves to the window: tell them when the head changed
    const h = this.main.querySelector(".study-head").offsetHeight;
    if (h !== this.headHeight) {
      this.headHeight = h;
      window.dispatchEvent(new Event("resize"));
    }
  }

  notFound(message) {
    this.missing = true;
    if (this.child) this.child.destroy();
    this.child = null;
    this.main.innerHTML = `
      <section class="page not-found" id="not-found">
        <h1>No study named “${esc(this.name)}”</h1>
        <p class="error-message">${esc(message)}</p>
        <p><a href="/" data-link>← all studies</a></p>
      </section>`;
    window.stagetree.ready = true;
  }

  renderSummary(s) {
    this.main.querySelector("#study-state").innerHTML = badge(s.state);
    const best = s.best === null || s.best === undefined
      ? "no metric yet"
      : `best ${esc(s.metric)} ${s.mode === "min" ? "(min)" : "(max)"} <strong>${fmtNum(s.best)}</strong>
         — trial #${esc(s.best_trial)}${s.best_step !== null && s.best_step !== undefined ? ` at step ${fmtInt(s.best_step)}` : ""}`;
    const workers = Object.keys(s.workers || {}).length;
    this.main.querySelector("#study-facts").innerHTML = `
      <span>${fmtInt(s.trials)} trials: ${fmtInt(s.finished)} done, ${fmtInt(s.running)} running,
        ${fmtInt(s.pending)} pending, ${fmtInt(s.failed)} failed${s.cancelled ? `, ${fmtInt(s.cancelled)} cancelled` : ""}</span>
      <span>${best}</span>
      ${workers ? `<span>${workers} worker${workers === 1 ? "" : "s"} at work</span>` : ""}`;
  }

  renderSavings(sv, s) {
    const box = this.main.querySelector("#savings");
    if (!sv) {
      box.innerHTML = "";
      return;
    }
    if (sv.estimate) {
      const e = sv.estimate;
      box.innerHTML = `
        <div class="saving-big" title="every trial alone ÷ the unique steps">
          <span class="x">${fmtRatio(e.merge_rate)}</span><span class="cap">estimated saving</span></div>
        <div class="saving-text">
          <div><strong>Not run yet.</strong> The ${esc(e.source)} estimates:</div>
          <div>every trial alone: <strong>${fmtInt(e.steps_alone)}</strong> steps;
               shared stages trained once: <strong>${fmtInt(e.steps_unique)}</strong> unique steps</div>
          <div>about <strong>${fmtSeconds(e.makespan_seconds)}</strong> on ${fmtInt(e.workers)}
               worker${e.workers === 1 ? "" : "s"}</div>
        </div>`;
      return;
    }
    const alone = sv.alone || {};
    const ran = sv.ran || {};
    const maxSteps = Math.max(alone.steps || 0, ran.steps || 0, 1);
    const bar = (v) => `${Math.max(0.5, (100 * (v || 0)) / maxSteps).toFixed(1)}%`;
    box.innerHTML = `
      <div class="saving-big" title="(steps that ran + steps saved) ÷ steps that ran">
        <span class="x">${fmtRatio(sv.ratio)}</span><span class="cap">saving</span></div>
      <div class="saving-bars">
        <div class="sb-row"><span class="sb-label" title="what ran + the steps sharing saved the finished trials">without sharing</span>
          <span class="sb-track"><span class="sb-bar alone" style="width:${bar(alone.steps)}"></span></span>
          <span class="sb-val">${fmtInt(alone.steps)} steps · ${fmtSeconds(alone.device_seconds)}</span></div>
        <div class="sb-row"><span class="sb-label">what ran</span>
          <span class="sb-track"><span class="sb-bar ran" style="width:${bar(ran.steps)}"></span></span>
          <span class="sb-val">${fmtInt(ran.steps)} steps · ${fmtSeconds(ran.device_seconds)}</span></div>
        <div class="sb-note">${sv.saved && sv.saved.steps !== null && sv.saved.steps !== undefined
          ? `${fmtInt(sv.saved.steps)} steps saved · ` : ""}${sv.seconds_per_step !== null && sv.seconds_per_step !== undefined
          ? `${fmtSeconds(sv.seconds_per_step)} per executed step` : ""}${
          s && s.merge_rate ? ` · merge rate of the plan ${fmtRatio(s.merge_rate)}` : ""}</div>
      </div>`;
  }

  update(info) {
    if (this.missing) {
      // the study may be created later: look again, and show it when it is there
      api.study(this.name).then(() => {
        if (!this.alive || !this.missing) return;
        this.missing = false;
        this.mount();
      }, () => {});
      return;
    }
    // the shown view first: on a large study the summary is the slower read
    const child = this.child ? this.child.update(info) : null;
    Promise.resolve(child).finally(() => this.refresh());
  }

  destroy() {
    this.alive = false;
    if (this.child) this.child.destroy();
    clearBanner("study");
  }
}
