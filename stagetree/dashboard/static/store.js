// The plan nodes of a study, kept in step with the server through the tree cursor
// (`tree?after=REV` sends only the nodes that changed since REV).

import { api } from "./api.js";

export class TreeData {
  constructor(name) {
    this.name = name;
    this.nodes = new Map();
    this.roots = [];
    this.maxStep = 1;
    this.revision = null;
  }

  // Fetches what changed; returns {full, changed: [ids], removed: [ids]}.
  async sync() {
    const data = await api.tree(this.name, this.revision ?? undefined);
    if (data.full) this.nodes = new Map();
    const changed = [];
    for (const n of data.nodes) {
      this.nodes.set(n.id, n);
      changed.push(n.id);
    }
    const removed = data.removed || [];
    for (const id of removed) this.nodes.delete(id);
    this.roots = data.roots || [];
    let maxStep = data.max_step || 0;
    if (!maxStep) for (const n of this.nodes.values()) maxStep = Math.max(maxStep, n.end);
    this.maxStep = Math.max(1, maxStep);
    this.revision = data.revision;
    return { full: !!data.full, changed, removed };
  }
}
