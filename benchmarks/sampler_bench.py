"""Model-based search inside stagetree: ASHA + TPE against Optuna's own TPE + pruner.

The study: the digits MLP (``_common.CountingDigitsTrainer``, one step = 8 minibatches of
64, SGD with momentum) on a random space written the way the README recommends for
sharing: the values that shape the prefix are discrete (initial learning rate, the
momentum and batch-size schedules), the continuous draw (the decay factor ``gamma``)
only acts from the first milestone on::

    lr = MultiStep(init=Choice([0.03, 0.1, 0.3]), milestones=Choice([[8], [12], [8, 12]]),
                   gamma=LogUniform(0.05, 0.5))
    momentum = Choice([0.9, Piecewise([0.5, 0.9], [4])])
    batch_size = Choice([64, Piecewise([64, 128], [8])])

Runners (each with seeds 0, 1, 2 by default; 16 steps a trial, rungs 1, 4, 16):

* ``random``: stagetree ``RandomSearch`` (every trial to 16 steps).
* ``asha``: stagetree ``ASHA(eta=4, min_steps=1, max_steps=16)``, random draws.
* ``asha+tpe``: the same ASHA with ``sampler=optuna.samplers.TPESampler(seed=seed)``.
* ``optuna``: Optuna's ``TPESampler(seed=seed)`` + ``SuccessiveHalvingPruner(
  min_resource=1, reduction_factor=4, min_early_stopping_rate=0)``, sequential, the same
  space (mapped by :func:`stagetree.tuners.optuna_bridge.suggest_trial`, so both search
  the same distributions), the objective reporting accuracy after every step.

stagetree runs on ``--workers`` worker processes (default 1) with one torch thread each;
Optuna in this process with one torch thread. Device-seconds: stagetree's
``study.stats()["device_seconds"]`` (workers' busy time); Optuna's, the time spent inside
the objective. Best-so-far: the best accuracy of a trial trained to 16 steps, recorded
at each result against the device-seconds spent until then. Steps executed: ``train()``
calls counted in every process; steps saved by sharing: the steps trials asked for
(``stats()["steps_requested"]``) minus those executed.

Trials: ``--trials`` (default 48, quick 16) for ``random`` and ``optuna``;
``--asha-trials`` (default 4 x that) for ``asha`` and ``asha+tpe``. The question is how
fast a runner *reaches* a target, so the ASHA runners must be able to go on after
their first trials reach 16 steps: with equal trial counts ASHA (eta 4: 1/16 of its
trials reach the top) stops after ~6x fewer steps than Optuna's pruner (which promotes
every trial that is the best so far at a rung) and ends before Optuna's time is up.
Pass ``--asha-trials`` equal to ``--trials`` for the equal-count comparison.

Goal: ASHA + TPE reaches Optuna's best accuracy (of the same seed) in at most half of
the device-seconds Optuna needed to reach it.

Run::

    .venv/bin/python benchmarks/sampler_bench.py --quick      # 16 trials a run (ASHA 64)
    .venv/bin/python benchmarks/sampler_bench.py              # 48 trials a run (ASHA 192)
    .venv/bin/python benchmarks/sampler_bench.py --asha-trials 48   # equal trial counts
    .venv/bin/python benchmarks/sampler_bench.py --runners asha+tpe,optuna --seeds 0
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import COUNTER_ENV, count_steps, machine_info, markdown_table, median, write_plot

HERE = Path(__file__).resolve().parent
RUNNERS = ("random", "asha", "asha+tpe", "optuna")
MAX_STEPS, MIN_STEPS, ETA = 16, 1, 4


def make_space() -> Any:
    """The random space of the module doc."""
    from stagetree.distributions import Choice, LogUniform
    from stagetree.hp import MultiStep, Piecewise
    from stagetree.space import RandomSpace

    return RandomSpace(
        hp={
            "lr": MultiStep(
                init=Choice([0.03, 0.1, 0.3]),
                milestones=Choice([[8], [12], [8, 12]]),
                gamma=LogUniform(0.05, 0.5),
            ),
            "momentum": Choice([0.9, Piecewise([0.5, 0.9], [4])]),
            "batch_size": Choice([64, Piecewise([64, 128], [8])]),
        },
        fixed={
            "optimizer": "momentum",
            "hidden": 512,
            "layers": 2,
            "batches_per_step": 8,
            "dropout": 0.1,
            "seed": 0,
        },
    )


def _best_so_far(points: list[tuple[float, float | None]]) -> list[tuple[float, float]]:
    """``(device-seconds, best accuracy at 16 steps so far)`` from raw observations."""
    out: list[tuple[float, float]] = []
    best = -math.inf
    for seconds, acc in sorted(points, key=lambda p: p[0]):
        if acc is not None and acc > best:
            best = acc
            out.append((seconds, best))
    return out


def run_stagetree(runner: str, seed: int, n: int, tmp: Path, workers: int) -> dict[str, Any]:
    import optuna
    from _common import CountingDigitsTrainer

    from stagetree import Study
    from stagetree.tuners import ASHA, RandomSearch

    counter = tmp / f"calls-{runner}-{seed}"
    os.environ[COUNTER_ENV] = str(counter)
    space = make_space()
    study = Study(
        f"bench-{runner}-{seed}",
        CountingDigitsTrainer,
        storage=f"sqlite:///{tmp / f'plan-{runner}-{seed}.db'}",
        workers=workers,
        threads_per_worker=1,
    )
    points: list[tuple[float, float | None]] = []

    def record(tuner_cls: type[Any]) -> type[Any]:
        class Recording(tuner_cls):  # type: ignore[misc, valid-type]
            def _observe(self, job: Any) -> float:
                v = super()._observe(job)
                result = job.result()
                acc = None
                if result is not None and result.steps == MAX_STEPS:
                    acc = float(result.metrics["accuracy"])
                points.append((study.stats()["device_seconds"], acc))
                return v

        Recording.__name__ = tuner_cls.__name__
        return Recording

    common = {"metric": "accuracy", "mode": "max", "seed": seed, "num_trials": n}
    if runner == "random":
        tuner = record(RandomSearch)(space, steps=MAX_STEPS, **common)
    else:
        sampler = optuna.samplers.TPESampler(seed=seed) if runner == "asha+tpe" else None
        tuner = record(ASHA)(
            space, min_steps=MIN_STEPS, max_steps=MAX_STEPS, eta=ETA, sampler=sampler, **common
        )
    try:
        study.tune(tuner)
        stats = study.stats()
    finally:
        study.close()
    executed = count_steps(counter)
    return {
        "curve": _best_so_far(points),
        "device_seconds": stats["device_seconds"],
        "steps_executed": executed,
        "steps_requested": stats.get("steps_requested"),
    }


def run_optuna(seed: int, n: int, tmp: Path) -> dict[str, Any]:
    import optuna
    import torch
    from _common import CountingDigitsTrainer

    from stagetree.tuners.optuna_bridge import suggest_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(1)
    counter = tmp / f"calls-optuna-{seed}"
    os.environ[COUNTER_ENV] = str(counter)
    space = make_space()
    spent = 0.0
    points: list[tuple[float, float | None]] = []
    requested = 0

    def objective(trial: optuna.Trial) -> float:
        nonlocal spent, requested
        spec = suggest_trial(space, trial)
        begin = time.perf_counter()
        try:
            trainer = CountingDigitsTrainer(dict(spec.config))
            acc = math.nan
            for t in range(MAX_STEPS):
                trainer.setup({name: seq(t) for name, seq in spec.hp.items()})
                trainer.train()
                requested += 1
                acc = float(trainer.evaluate()["accuracy"])
                trial.report(acc, t + 1)
                if trial.should_prune():
                    points.append((spent + time.perf_counter() - begin, None))
                    raise optuna.TrialPruned()
        finally:
            spent += time.perf_counter() - begin
        points.append((spent, acc))
        return acc

    study = optuna.create_study(
        direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=optuna.pruners.SuccessiveHalvingPruner(
            min_resource=MIN_STEPS, reduction_factor=ETA, min_early_stopping_rate=0
        ),
    )
    study.optimize(objective, n_trials=n)
    return {
        "curve": _best_so_far(points),
        "device_seconds": spent,
        "steps_executed": count_steps(counter),
        "steps_requested": requested,
    }


def _acc(value: float | None) -> str | None:
    return None if value is None else f"{value:.4f}"


def reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """Device-seconds at which ``curve`` first reaches ``target`` (None: never)."""
    for seconds, best in curve:
        if best >= target - 1e-12:
            return seconds
    return None


def plot(path: str, results: dict[str, dict[int, dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for k, (runner, by_seed) in enumerate(results.items()):
        for i, res in enumerate(by_seed.values()):
            curve = res["curve"]
            if not curve:
                continue
            xs = [s for s, _ in curve] + [res["device_seconds"]]
            ys = [b for _, b in curve] + [curve[-1][1]]
            ax.step(
                xs, ys, where="post", color=f"C{k}", alpha=0.8, label=runner if i == 0 else None
            )
    ax.set_xlabel("device-seconds")
    ax.set_ylabel("best accuracy at 16 steps so far")
    ax.set_title("digits MLP, random space: best-so-far vs device-seconds (one line per seed)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 trials a run (default 48)")
    parser.add_argument("--trials", type=int, default=None, help="trials a run")
    parser.add_argument(
        "--asha-trials",
        type=int,
        default=None,
        help="trials of the ASHA runners (default 4 x --trials: see the module doc)",
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--runners", default=",".join(RUNNERS), help=f"from {RUNNERS}")
    parser.add_argument("--workers", type=int, default=1, help="stagetree worker processes")
    parser.add_argument("--plot", default=str(HERE / "out" / "sampler_bench.png"))
    args = parser.parse_args(argv)
    runners = [r for r in args.runners.split(",") if r]
    unknown = sorted(set(runners) - set(RUNNERS))
    if unknown:
        parser.error(f"unknown runners {unknown}; choose from {RUNNERS}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    n = args.trials or (16 if args.quick else 48)
    n_asha = args.asha_trials or 4 * n
    try:
        import optuna
    except ImportError:
        print("sampler_bench needs optuna: pip install 'stagetree[optuna]'", file=sys.stderr)
        return 1
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    print(" ".join(f"{k}={v}" for k, v in machine_info().items()))
    print(
        f"{n} trials a run ({n_asha} for the ASHA runners), seeds {seeds}, "
        f"stagetree workers {args.workers}\n"
    )
    results: dict[str, dict[int, dict[str, Any]]] = {r: {} for r in runners}
    with tempfile.TemporaryDirectory(prefix="sampler-bench-") as tmpdir:
        tmp = Path(tmpdir)
        for seed in seeds:
            for runner in runners:
                begin = time.perf_counter()
                if runner == "optuna":
                    res = run_optuna(seed, n, tmp)
                else:
                    trials = n_asha if runner.startswith("asha") else n
                    res = run_stagetree(runner, seed, trials, tmp, args.workers)
                best = res["curve"][-1][1] if res["curve"] else None
                print(
                    f"  seed {seed} {runner:9s} best {best if best is None else round(best, 4)} "
                    f"device-s {res['device_seconds']:.1f} steps {res['steps_executed']} "
                    f"(wall {time.perf_counter() - begin:.1f} s)",
                    flush=True,
                )
                results[runner][seed] = res

    rows = []
    for runner, by_seed in results.items():
        finals = [r["curve"][-1][1] if r["curve"] else None for r in by_seed.values()]
        saved = []
        for r in by_seed.values():
            if r["steps_requested"]:
                saved.append(1 - r["steps_executed"] / r["steps_requested"])
        to_optuna: list[float | None] = []
        if "optuna" in results and runner != "optuna":
            for seed, r in by_seed.items():
                opt = results["optuna"].get(seed)
                if opt and opt["curve"]:
                    target = opt["curve"][-1][1]
                    t_opt = reach(opt["curve"], target)
                    t_me = reach(r["curve"], target)
                    to_optuna.append(None if t_me is None or not t_opt else t_me / t_opt)
        reached = sum(x is not None for x in to_optuna)
        worst = min((f for f in finals if f is not None), default=None)
        rows.append(
            [
                runner,
                _acc(median(finals)),
                _acc(worst),
                median(r["device_seconds"] for r in by_seed.values()),
                median(r["steps_executed"] for r in by_seed.values()),
                int(median(r["steps_requested"] for r in by_seed.values()) or 0),
                None if not saved else f"{100 * median(saved):.0f}%",  # type: ignore[operator]
                "-" if not to_optuna else f"{reached}/{len(to_optuna)}",
                median(to_optuna) if to_optuna else None,
            ]
        )
    headers = [
        "runner",
        "best acc (median)",
        "best acc (worst seed)",
        "device-s",
        "steps executed",
        "steps requested",
        "saved by sharing",
        "seeds reaching Optuna's best",
        "device-s to Optuna's best / Optuna's (median)",
    ]
    print()
    print(markdown_table(headers, rows))
    if "asha+tpe" in results and "optuna" in results:
        ratios = []
        for seed, r in results["asha+tpe"].items():
            opt = results["optuna"].get(seed)
            if opt and opt["curve"]:
                target = opt["curve"][-1][1]
                t_me, t_opt = reach(r["curve"], target), reach(opt["curve"], target)
                ratios.append(None if t_me is None or not t_opt else t_me / t_opt)
        met = bool(ratios) and all(x is not None and x <= 0.5 for x in ratios)
        shown = ", ".join("never" if x is None else f"{x:.2f}" for x in ratios)
        print(
            f"\ngoal (ASHA + TPE reaches Optuna's best in <= 1/2 of Optuna's device-seconds, "
            f"every seed): {'met' if met else 'not met'} (ratios per seed: {shown})"
        )
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    write_plot(args.plot, plot, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
