// The dashboard: a one-page app. The page and the study's view are in the URL path
// (/, /study/NAME, /study/NAME/VIEW) so that every view can be linked; live updates come
// from a long-poll on /api/changes.

import { api } from "./api.js";
import { StudiesView } from "./studies.js";
import { StudyPage, VIEWS } from "./study.js";
import { esc, setLive, showBanner, clearBanner, sleep, studyHref } from "./ui.js";

// For tests and benchmarks: the tree's nodes by id, the count of drawn node elements,
// the last revision applied, and whether the shown view has painted once.
window.stagetree = { tree: { nodes: new Map() }, rendered: 0, revision: 0, ready: false };

const main = document.getElementById("main");
let page = null; // StudiesView | StudyPage
let revision = 0; // the storage's revision as last seen by the long-poll

function parseRoute(pathname) {
  const parts = pathname.split("/").filter(Boolean);
  if (parts[0] === "study" && parts.length >= 2) {
    const view = parts[2] ? decodeURIComponent(parts[2]) : "tree";
    return { page: "study", name: decodeURIComponent(parts[1]), view };
  }
  return { page: "studies" };
}

function crumbs(route) {
  const nav = document.getElementById("crumbs");
  if (route.page === "study") {
    nav.innerHTML = `<a href="/" data-link>studies</a><span class="sep">›</span>` +
      `<a href="${esc(studyHref(route.name))}" data-link>${esc(route.name)}</a>`;
  } else {
    nav.innerHTML = `<span>studies</span>`;
  }
}

async function route() {
  const r = parseRoute(window.location.pathname);
  crumbs(r);
  window.stagetree.ready = false;
  if (r.page === "study" && page instanceof StudyPage && page.name === r.name) {
    await page.show(VIEWS.includes(r.view) ? r.view : "tree");
    return;
  }
  if (page) page.destroy();
  main.innerHTML = "";
  if (r.page === "study") {
    document.title = `${r.name} · stagetree`;
    page = new StudyPage(main, r.name, r.view);
  } else {
    document.title = "studies · stagetree";
    page = new StudiesView(main);
  }
  await page.mount();
}

export function navigate(href) {
  if (href !== window.location.pathname + window.location.search) {
    window.history.pushState({}, "", href);
  }
  route();
}

document.addEventListener("click", (event) => {
  if (event.defaultPrevented || event.button !== 0) return;
  if (event.metaKey || event.ctrlKey || event.shiftKey || event.altKey) return;
  const a = event.target.closest("a[data-link]");
  if (!a) return;
  event.preventDefault();
  navigate(a.getAttribute("href"));
});

window.addEventListener("popstate", () => route());

// ------------------------------------------------------------------ live updates
// While a study runs, the revision changes many times a second: the page redraws at
// most every MIN_GAP ms (an update still shows within a second of the change), and not
// at all while its tab is hidden, so that a browser on the training machine takes
// little of its CPU.
const MIN_GAP = 400;

function visible() {
  if (!document.hidden) return Promise.resolve();
  return new Promise((resolve) => {
    const on = () => {
      if (document.hidden) return;
      document.removeEventListener("visibilitychange", on);
      resolve();
    };
    document.addEventListener("visibilitychange", on);
  });
}

async function liveLoop() {
  let failures = 0;
  let last = 0; // when the shown view was last told of a change
  for (;;) {
    try {
      await visible();
      const gap = MIN_GAP - (performance.now() - last);
      if (gap > 0) await sleep(gap);
      const answer = await api.changes(revision, 25);
      const recovered = failures > 0;
      failures = 0;
      clearBanner("live");
      const r = answer.revision;
      setLive("live", `live · rev ${r}`);
      if (r !== revision || recovered) {
        // after an outage the shown view may have failed to load: fetch it again; a
        // smaller revision: another storage behind the same address, start over
        const reset = r < revision;
        revision = r;
        last = performance.now();
        if (page) page.update({ revision: r, reset });
      }
    } catch (err) {
      failures += 1;
      const wait = Math.min(500 * 2 ** (failures - 1), 10000);
      setLive(failures > 3 ? "offline" : "reconnecting", failures > 3 ? "offline, retrying" : "reconnecting…");
      if (failures > 3) showBanner("live", `Live updates stopped: ${err.message}. Retrying every ${Math.round(wait / 1000)} s.`);
      await sleep(wait);
    }
  }
}

async function boot() {
  // The shown view first (a large study's tree should not wait behind other reads),
  // then the storage's URL for the header; live updates start from the revision the
  // view was read at, so that nothing after it is missed.
  await route();
  revision = window.stagetree.revision || 0;
  const header = document.getElementById("storage-url");
  if (!header.textContent || !revision) {
    try {
      const s = await api.studies();
      header.textContent = s.url;
      if (!revision) revision = s.revision;
    } catch (err) {
      showBanner("boot", `Could not read the studies: ${err.message}`);
    }
  }
  setLive("live", `live · rev ${revision}`);
  liveLoop();
}

boot();
