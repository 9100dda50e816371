// The JSON API of docs/dashboard-api.md.

export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status; // 0: the server could not be reached
  }
}

export async function getJSON(path, { signal } = {}) {
  let resp;
  try {
    resp = await fetch(path, {
      signal,
      headers: { Accept: "application/json" },
      credentials: "same-origin",
      cache: "no-store",
    });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(`cannot reach the dashboard server (${err.message})`, 0);
  }
  const text = await resp.text();
  let body = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch {
    body = null;
  }
  if (!resp.ok) {
    const message = body && body.error ? body.error : `${resp.status} ${resp.statusText} for ${path}`;
    throw new ApiError(message, resp.status);
  }
  if (body === null || typeof body !== "object") {
    throw new ApiError(`the server sent no JSON for ${path}`, resp.status);
  }
  return body;
}

const enc = encodeURIComponent;
const study = (name) => `/api/studies/${enc(name)}`;
const query = (params) => {
  const q = Object.entries(params)
    .filter(([, v]) => v !== undefined && v !== null)
    .map(([k, v]) => `${k}=${enc(v)}`)
    .join("&");
  return q ? `?${q}` : "";
};

export const api = {
  changes: (after, timeout, signal) => getJSON(`/api/changes${query({ after, timeout })}`, { signal }),
  studies: () => getJSON("/api/studies"),
  study: (name) => getJSON(study(name)),
  tree: (name, after) => getJSON(`${study(name)}/tree${query({ after })}`),
  node: (name, id) => getJSON(`${study(name)}/nodes/${enc(id)}`),
  curves: (name, metric) => getJSON(`${study(name)}/curves${query({ metric })}`),
  trials: (name) => getJSON(`${study(name)}/trials`),
  timeline: (name, after) => getJSON(`${study(name)}/timeline${query({ after })}`),
};
