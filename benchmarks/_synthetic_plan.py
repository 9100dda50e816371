"""A finished study of any size written straight into a plan storage, in seconds, for
the dashboard's benchmark (and anyone who wants to look at a large stage tree).

Running 10,000 trials through the real engine (even on simulated workers) takes many
minutes on this machine, because the scheduler rebuilds its stage tree at every
decision; the dashboard only reads what a study leaves behind. So this writes what a
finished grid study leaves in the plan, through the public storage API: the trials'
paths (learning-rate, momentum and batch-size schedules that share prefixes), done
requests, one metric per step along every node (a deterministic function of the path,
so shared prefixes have equal metrics), checkpoints where trials branch off, the study
and trial rows, the accounting counters, and an activity log of batches on
``workers`` workers laid out in time as a greedy list schedule would run them.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from typing import Any

from stagetree.hp import Constant, MultiStep, Piecewise, Sequence
from stagetree.plan import BasePlanStorage, RequestState

__all__ = ["STUDY", "synthetic_hp", "write_study"]

STUDY = "bench"
_VERSION = "synthetic"
_ROOT = "synthetic-root"


def synthetic_hp(trials: int, steps: int) -> list[dict[str, Sequence]]:
    """``trials`` distinct sequence dicts that share prefixes like a grid does: the
    learning rate's initial value and first milestone vary slowest, late momentum and
    batch-size changes fastest."""
    inits = [0.1, 0.05, 0.02, 0.01, 0.2, 0.15, 0.07]
    gammas = [0.1, 0.2, 0.3, 0.5, 0.7]
    firsts = [steps // 6 * k for k in (1, 2, 3)]
    late = [steps * 2 // 3, steps * 3 // 4, steps * 5 // 6]
    momenta: list[Sequence] = [Constant(0.9)] + [
        Piecewise([0.9, v], [s]) for s in late for v in (0.5, 0.8, 0.95)
    ]
    batches: list[Sequence] = [Constant(128)] + [
        Piecewise([128, b], [s]) for s in late for b in (64, 256, 512)
    ]

    def grid() -> Iterator[dict[str, Sequence]]:
        for init, first, gamma in itertools.product(inits, firsts, gammas):
            lr = MultiStep(init, [first], gamma)
            for mom, bs in itertools.product(momenta, batches):
                yield {"lr": lr, "momentum": mom, "batch_size": bs}

    out = list(itertools.islice(grid(), trials))
    if len(out) < trials:
        raise ValueError(f"the synthetic grid has {len(out)} trials, fewer than {trials}")
    return out


def _accuracy(values: dict[str, float], state: float) -> float:
    """One step of a made-up learning curve: progress grows with the learning rate, less
    with momentum off 0.9 and with a large batch."""
    rate = values["lr"] * (1.0 - abs(values["momentum"] - 0.9)) * (128.0 / values["batch_size"])
    return state + (1.0 - state) * min(0.2, 0.5 * rate)


def write_study(
    storage: BasePlanStorage,
    trials: int,
    steps: int = 60,
    workers: int = 8,
    seconds_per_step: float = 0.05,
    name: str = STUDY,
) -> dict[str, float]:
    """Write a finished study of ``trials`` trials into ``storage`` (empty, or without
    study ``name``). Returns what was written: trials, nodes, unique steps, metric
    points, checkpoints, activity records."""
    hps = synthetic_hp(trials, steps)
    config: dict[str, Any] = {"model": "synthetic"}
    storage.register_root(_ROOT, config)
    inserted = storage.insert_trials(_ROOT, [(hp, steps) for hp in hps])
    nodes = {n.id: n for n in storage.nodes(_ROOT)}
    children: dict[int, list[int]] = {}
    for n in nodes.values():
        if n.parent is not None:
            children.setdefault(n.parent, []).append(n.id)

    # Each node's last step: the end of the longest trial through it.
    end: dict[int, int] = {}
    for ins in inserted:
        node: int | None = ins.node
        while node is not None:
            end[node] = max(end.get(node, 0), ins.step)
            node = nodes[node].parent

    # Metrics along every node (once per canonical step), from its parent's state.
    points: list[tuple[int, int, dict[str, float], bool]] = []

    def walk(node_id: int, state: float) -> None:
        n = nodes[node_id]
        start = n.branch_step if n.parent is not None else 0
        states = {start: state}  # the model's state after s steps, s >= start
        for s in range(start + 1, end[node_id] + 1):
            values = {k: float(seq(s - 1)) for k, seq in n.hp.items()}
            state = _accuracy(values, state)
            states[s] = state
            points.append((node_id, s, {"accuracy": state, "loss": 1.0 - state}, True))
        for c in children.get(node_id, []):
            walk(c, states[nodes[c].branch_step])

    root_id = next(i for i, n in nodes.items() if n.parent is None)
    walk(root_id, 0.1)
    storage.put_metrics_many(points)

    # Checkpoints where children branch off, and at every trial's end.
    ckpts = {(nodes[c].parent, nodes[c].branch_step) for c in nodes if nodes[c].parent}
    ckpts |= {(ins.node, ins.step) for ins in inserted}
    for node_id, step in sorted(ckpts, key=lambda k: (k[0] or 0, k[1])):
        if node_id is not None and step > 0:
            storage.put_checkpoint(node_id, step, f"synthetic/{node_id}-{step}", 4096)
    for ins in inserted:
        storage.set_request_state(ins.node, ins.step, RequestState.DONE)

    meta = {
        "version": _VERSION,
        "share": True,
        "metric": "accuracy",
        "mode": "max",
        "tuner": "GridSearch",
        "horizon": steps,
    }
    storage.create_study(name, meta)
    for hp, ins in zip(hps, inserted):
        storage.add_trial(
            name,
            _ROOT,
            config,
            hp,
            steps,
            ins.node,
            ins.step,
            state="done",
            attrs={"version": _VERSION},
        )

    # One batch per node (its own steps), on the worker that frees first.
    unique = sum(
        end[i] - (nodes[i].branch_step if nodes[i].parent is not None else 0) for i in nodes
    )
    free = [0.0] * workers
    t0 = time.time() - unique * seconds_per_step / workers - 60.0
    records: list[dict[str, Any]] = []
    order = sorted(nodes, key=lambda i: (nodes[i].branch_step, i))
    for batch, node_id in enumerate(order, start=1):
        n = nodes[node_id]
        start = n.branch_step if n.parent is not None else 0
        busy = (end[node_id] - start) * seconds_per_step
        worker = min(range(workers), key=free.__getitem__)
        began = t0 + free[worker]
        free[worker] += busy + 0.02
        common = {"owner": "synthetic", "batch": batch, "worker": worker, "root_key": _ROOT}
        records.append(
            {
                **common,
                "kind": "start",
                "time": began,
                "data": {
                    "segments": [[node_id, start, end[node_id]]],
                    "start_step": start,
                    "stop_step": end[node_id],
                    "location": f"synthetic:{worker}",
                },
            }
        )
        for node_c, step_c in ((node_id, s) for s in range(start + 1, end[node_id] + 1)):
            if (node_c, step_c) in ckpts:
                at = began + (step_c - start) * seconds_per_step
                records.append(
                    {
                        **common,
                        "kind": "save",
                        "time": at,
                        "node": node_c,
                        "step": step_c,
                        "seconds": 0.01,
                        "data": {"nbytes": 4096},
                    }
                )
        records.append(
            {
                **common,
                "kind": "done",
                "time": began + busy,
                "seconds": busy,
                "data": {"steps": end[node_id] - start, "load_seconds": 0.0},
            }
        )
    storage.record_activity(records)

    seconds = unique * seconds_per_step
    for scope in ("engine", f"study:{name}@{_VERSION}", f"root:{_ROOT}"):
        storage.add_stats(scope, steps_executed=unique, device_seconds=seconds)
    return {
        "trials": float(trials),
        "nodes": float(len(nodes)),
        "steps_requested": float(trials * steps),
        "steps_unique": float(unique),
        "metric_points": float(len(points)),
        "checkpoints": float(len(ckpts)),
        "activity": float(len(records)),
        "merge_rate": trials * steps / unique if unique else math.nan,
    }
