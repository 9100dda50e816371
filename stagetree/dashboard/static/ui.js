// Shared helpers: formatting, the banner, the live indicator, the tooltip.

const d3 = window.d3;

export const STATE_COLOURS = {
  // Okabe–Ito: distinguishable with the common colour-vision deficiencies.
  trained: "#0072B2",
  training: "#E69F00",
  pending: "#8c8c8c",
  failed: "#D55E00",
  cancelled: "#CC79A7",
  declared: "#b5b5b5",
};

export const BATCH_COLOURS = {
  done: STATE_COLOURS.trained,
  running: STATE_COLOURS.training,
  failed: STATE_COLOURS.failed,
  lost: STATE_COLOURS.cancelled,
};

export function esc(value) {
  return String(value ?? "").replace(/[&<>"']/g, (c) => ({
    "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;",
  })[c]);
}

const num4 = d3.format(".4~g");
const int = d3.format(",d");

export function fmtNum(v) {
  if (v === null || v === undefined) return "—";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v) && Math.abs(v) < 1e6) return int(v);
  return num4(v);
}

export function fmtInt(v) {
  return v === null || v === undefined ? "—" : int(Math.round(v));
}

export function fmtRatio(v) {
  return v === null || v === undefined ? "—" : `×${d3.format(".3~r")(v)}`;
}

export function fmtSeconds(s) {
  if (s === null || s === undefined) return "—";
  if (s < 1) return `${d3.format(".2~r")(s)} s`;
  if (s < 120) return `${d3.format(".3~r")(s)} s`;
  if (s < 7200) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  return `${d3.format(".3~r")(s / 3600)} h`;
}

export function fmtClock(t) {
  if (t === null || t === undefined) return "—";
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}

export function fmtValue(v) {
  // a hyper-parameter value: numbers compactly, anything else as JSON
  if (typeof v === "number") return fmtNum(v);
  if (typeof v === "string") return v;
  return JSON.stringify(v);
}

// Text measured in a font (a canvas, not the layout): for fitting labels into columns.
let measurer = null;
export function textWidth(text, font) {
  if (!measurer) measurer = document.createElement("canvas").getContext("2d");
  if (measurer.font !== font) measurer.font = font;
  return measurer.measureText(text).width;
}

// `text`, cut with an ellipsis to at most `width` pixels in `font`.
export function fitText(text, width, font) {
  text = String(text ?? "");
  if (textWidth(text, font) <= width) return text;
  let lo = 0;
  let hi = text.length;
  while (lo < hi) {
    const mid = Math.ceil((lo + hi) / 2);
    if (textWidth(`${text.slice(0, mid)}…`, font) <= width) lo = mid;
    else hi = mid - 1;
  }
  return lo ? `${text.slice(0, lo)}…` : "";
}

export function uiFont(size, weight = 400) {
  const family = getComputedStyle(document.documentElement).fontFamily;
  return `${weight} ${size}px ${family}`;
}

export function truncate(text, n) {
  text = String(text ?? "");
  return text.length > n ? `${text.slice(0, Math.max(1, n - 1))}…` : text;
}

export function el(tag, attrs = {}, html = "") {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v !== null && v !== undefined && v !== false) node.setAttribute(k, v === true ? "" : v);
  }
  if (html) node.innerHTML = html;
  return node;
}

export function badge(state) {
  return `<span class="badge st-${esc(state)}">${esc(state)}</span>`;
}

// ------------------------------------------------------------------ banner
const banners = new Map();

export function showBanner(key, message) {
  banners.set(key, message);
  renderBanner();
}

export function clearBanner(key) {
  if (banners.delete(key)) renderBanner();
}

function renderBanner() {
  const box = document.getElementById("banner");
  if (!banners.size) {
    box.hidden = true;
    box.textContent = "";
    return;
  }
  box.hidden = false;
  box.innerHTML = [...banners.values()].map((m) => `<div>${esc(m)}</div>`).join("");
}

// ------------------------------------------------------------------ live indicator
export function setLive(status, text) {
  const box = document.getElementById("live");
  box.dataset.status = status;
  box.querySelector(".live-text").textContent = text;
}

// ------------------------------------------------------------------ tooltip
export function showTooltip(html, event) {
  const tip = document.getElementById("tooltip");
  tip.innerHTML = html;
  tip.hidden = false;
  const pad = 14;
  const { innerWidth: w, innerHeight: h } = window;
  const r = tip.getBoundingClientRect();
  let x = event.clientX + pad;
  let y = event.clientY + pad;
  if (x + r.width > w - 4) x = Math.max(4, event.clientX - r.width - pad);
  if (y + r.height > h - 4) y = Math.max(4, event.clientY - r.height - pad);
  tip.style.left = `${x}px`;
  tip.style.top = `${y}px`;
}

export function hideTooltip() {
  document.getElementById("tooltip").hidden = true;
}

// ------------------------------------------------------------------ misc
export function studyHref(name, view) {
  const base = `/study/${encodeURIComponent(name)}`;
  return view && view !== "tree" ? `${base}/${encodeURIComponent(view)}` : base;
}

export function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

// Runs `fn` now, or once more after the running call when asked again meanwhile:
// live updates never overlap and never pile up.
export function coalesce(fn) {
  let running = null;
  let again = false;
  const run = async () => {
    if (running) {
      again = true;
      return running;
    }
    running = (async () => {
      try {
        do {
          again = false;
          await fn();
        } while (again);
      } finally {
        running = null;
      }
    })();
    return running;
  };
  return run;
}

// A view's first load: read and draw, then (once the browser has painted it) tell
// tests and benchmarks, unless the view was left meanwhile. Returns whether it is shown.
export async function firstPaint(view) {
  await view.refresh();
  if (!view.alive) return false;
  await afterPaint();
  if (view.alive) window.stagetree.ready = true;
  return view.alive;
}

export function afterPaint() {
  return new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve)));
}
