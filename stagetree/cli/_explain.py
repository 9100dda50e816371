"""``stagetree explain SPACE.py``: load a space file
(:func:`stagetree.space.load_space_file`), plan every trial in memory and print what
sharing saves (trials, root keys, total and unique steps, merge rate), the shares
missed by values that are close but not equal, and the stage tree, before anything is
trained."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from stagetree.cli._options import positive
from stagetree.exceptions import InvalidSpaceError
from stagetree.hp import Sequence, first_difference
from stagetree.plan.base import BasePlanStorage
from stagetree.plan.memory import MemoryPlanStorage
from stagetree.plan.tree import names_key
from stagetree.space import SpaceFile, TrialSpec, canonical_json, config_key, load_space_file
from stagetree.stages import Summary, build_stage_tree, render_tree, summarize

__all__ = [
    "ExplainResult",
    "NearMiss",
    "add_parser",
    "explain",
    "near_misses",
    "plan_trials",
    "tree_lines",
]

# Two numbers closer than this (relative) are taken for one value written two ways.
NEAR = 1e-9
# Distinct sequences per name and tree compared pairwise at most (a random space's
# continuous draws are all distinct and never near: comparing them is wasted time).
_MAX_PAIRED = 300


@dataclass(frozen=True)
class NearMiss:
    """Two sequences of one name that would share steps if two close values were equal.

    Attributes:
        name: the hyper-parameter.
        step: the first step where they differ.
        values: their values there (close, not equal).
        sequences: the two sequences.
    """

    name: str
    step: int
    values: tuple[int | float, int | float]
    sequences: tuple[Sequence, Sequence]

    def line(self) -> str:
        """One line for the report."""
        a, b = self.values
        return (
            f"{self.name}: {a!r} and {b!r} differ by {abs(a - b):.3g} at step {self.step} "
            f"({self.sequences[0]!r} vs {self.sequences[1]!r}); write them equal to share"
        )


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def near_misses(
    trials: Iterable[tuple[str, Mapping[str, Sequence], int]], rel: float = NEAR
) -> list[NearMiss]:
    """Pairs of sequences (same name, same plan tree) whose first difference is two
    numbers within ``rel`` of each other (``0.1`` and ``0.1000000001``, ``0.3`` and
    ``0.1 + 0.2``): shares a space misses by a rounding.

    Args:
        trials: ``(root key, sequences by name, steps)`` of each trial.
        rel: largest relative difference taken for a near miss.
    """
    groups: dict[tuple[str, str], dict[Sequence, int]] = {}
    for key, hp, steps in trials:
        for name, seq in hp.items():
            seqs = groups.setdefault((key, name), {})
            seqs[seq] = max(seqs.get(seq, 0), steps)
    out: list[NearMiss] = []
    seen: set[tuple[str, Any, Any]] = set()
    for (_, name), seqs in groups.items():
        items = list(seqs.items())[:_MAX_PAIRED]
        for i, (a, sa) in enumerate(items):
            for b, sb in items[i + 1 :]:
                d = first_difference(a, b, 0, min(sa, sb))
                if d is None:
                    continue
                raw_a, raw_b = a(d), b(d)
                if not (_is_number(raw_a) and _is_number(raw_b)):
                    continue
                va, vb = float(raw_a), float(raw_b)
                if abs(va - vb) > rel * max(abs(va), abs(vb)):
                    continue
                mark = (name, min(va, vb), max(va, vb))
                if mark not in seen:
                    seen.add(mark)
                    out.append(NearMiss(name, d, (va, vb), (a, b)))
    return out


@dataclass
class ExplainResult:
    """An in-memory plan of a space and its sharing statistics.

    Attributes:
        storage: the memory plan holding every trial (one request reference each).
        root_keys: root key -> fixed config, in order of first appearance.
        summary: :func:`stagetree.stages.summarize` of the plan.
        trials_per_root: root key -> number of trials in that tree.
        near_misses: shares missed by close but unequal values (:func:`near_misses`).
    """

    storage: BasePlanStorage
    root_keys: dict[str, dict[str, Any]]
    summary: Summary
    trials_per_root: dict[str, int] = field(default_factory=dict)
    near_misses: list[NearMiss] = field(default_factory=list)


def plan_trials(
    trials: Iterable[TrialSpec],
    steps: int | Callable[[TrialSpec], int],
    study: str = "explain",
    storage: BasePlanStorage | None = None,
) -> ExplainResult:
    """Insert trials into a plan and summarise the sharing.

    One root key per distinct fixed config (:func:`stagetree.space.config_key`), and
    one more per other set of hyper-parameter names under it
    (:func:`stagetree.plan.tree.names_key`), each registered with its config; every
    trial is inserted with its step count, which adds one request reference per trial,
    and recorded as a trial of ``study`` so that identical trials count twice.

    Args:
        trials: the trials.
        steps: steps per trial, or a function of the trial.
        study: name of the study the trials are recorded under.
        storage: plan to fill; a fresh :class:`MemoryPlanStorage` when None.

    Raises:
        InvalidSpaceError: ``steps`` gave something other than an int >= 1.
    """
    plan = MemoryPlanStorage() if storage is None else storage
    plan.create_study(study, {"source": "stagetree explain"})
    grouped: dict[str, list[tuple[TrialSpec, int]]] = {}
    configs: dict[str, dict[str, Any]] = {}
    first_names: dict[str, tuple[str, ...]] = {}
    for trial in trials:
        n = steps(trial) if callable(steps) else steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidSpaceError(f"steps must be an int >= 1, got {n!r} for {trial!r}")
        # A config's first name set has its tree; another one a tree of its own.
        base, names = config_key(trial.config), tuple(sorted(trial.hp))
        key = base if first_names.setdefault(base, names) == names else names_key(base, names)
        if key not in configs:
            configs[key] = trial.root_config
            plan.register_root(key, trial.root_config)
        grouped.setdefault(key, []).append((trial, n))
    for key, items in grouped.items():
        insertions = plan.insert_trials(key, [(t.hp, n) for t, n in items])
        for (trial, n), ins in zip(items, insertions):
            plan.add_trial(study, key, trial.config, trial.hp, n, ins.node, ins.step)
    return ExplainResult(
        storage=plan,
        root_keys=configs,
        summary=summarize(plan, study=study),
        trials_per_root={k: len(v) for k, v in grouped.items()},
        near_misses=near_misses((key, t.hp, n) for key, items in grouped.items() for t, n in items),
    )


def _config_text(config: Mapping[str, Any]) -> str:
    if not config:
        return "(no fixed hyper-parameters)"
    return " ".join(
        f"{k}={v if isinstance(v, str) else canonical_json(v)}" for k, v in config.items()
    )


def tree_lines(result: ExplainResult) -> list[str]:
    """The stage tree of every plan tree, each under a header naming its root key."""
    lines: list[str] = []
    for key, config in result.root_keys.items():
        count = result.trials_per_root.get(key, 0)
        lines.append(f"root {key}  {_config_text(config)}  ({count} trials)")
        nodes = {n.id: n for n in result.storage.nodes(key)}
        requests = [(r.node, r.step) for r in result.storage.requests(key)]
        text = render_tree(build_stage_tree(nodes, requests), max_lines=10**9)
        lines.extend("  " + line for line in text.splitlines())
    return lines


def _collapse(lines: list[str], max_lines: int) -> list[str]:
    if len(lines) <= max_lines:
        return lines
    return [*lines[:max_lines], f"... {len(lines) - max_lines} more lines"]


def _summary_rows(result: ExplainResult) -> list[tuple[str, str]]:
    s = result.summary
    return [
        ("trials", str(s.trials)),
        ("root keys", str(len(result.root_keys))),
        ("plan nodes", str(s.nodes)),
        ("total steps", str(s.total_steps)),
        ("unique steps", str(s.unique_steps)),
        ("merge rate", f"{s.merge_rate:.2f}"),
    ]


def explain(
    space_file: SpaceFile,
    *,
    steps: int | None = None,
    num_trials: int | None = None,
    seed: int | None = None,
    max_lines: int = 60,
    out: TextIO | None = None,
    rich_output: bool | None = None,
) -> ExplainResult:
    """Plan a space file in memory and print what sharing saves.

    Args:
        space_file: the loaded space file.
        steps: overrides the file's ``steps``.
        num_trials: overrides the file's ``num_trials``.
        seed: overrides the file's ``seed``.
        max_lines: stage-tree lines to print at most; the rest collapse.
        out: where to print (default: ``sys.stdout`` at call time).
        rich_output: a rich table instead of plain text (default: ``out`` is a terminal).

    Returns:
        The plan and its summary.
    """
    stream = sys.stdout if out is None else out
    trials = space_file.trials(num_trials=num_trials, seed=seed)
    result = plan_trials(
        trials,
        space_file.steps_for if steps is None else steps,
        study=space_file.name,
    )
    rows = _summary_rows(result)
    lines = _collapse(tree_lines(result), max_lines)
    missed = _collapse([m.line() for m in result.near_misses], 10)
    where = f" ({space_file.path})" if space_file.path is not None else ""
    title = f"{space_file.name}{where}"
    use_rich = stream.isatty() if rich_output is None else rich_output
    if use_rich:
        from rich.console import Console
        from rich.table import Table

        console = Console(file=stream)
        console.print(title, style="bold", markup=False, highlight=False)
        table = Table(show_header=False)
        table.add_column(style="bold")
        table.add_column(justify="right")
        for label, value in rows:
            table.add_row(label, value)
        console.print(table)
        if missed:
            console.print("missed shares (close values, not equal):", style="bold")
            console.print("\n".join(missed), markup=False, highlight=False, soft_wrap=True)
        console.print("stage tree:", style="bold")
        console.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)
    else:
        print(title, file=stream)
        for label, value in rows:
            print(f"{label + ':':<14}{value}", file=stream)
        print("", file=stream)
        if missed:
            print("missed shares (close values, not equal):", file=stream)
            for line in missed:
                print("  " + line, file=stream)
            print("", file=stream)
        print("stage tree:", file=stream)
        for line in lines:
            print(line, file=stream)
    return result


def _cmd_explain(args: argparse.Namespace) -> int:
    explain(
        load_space_file(args.space, num_trials=args.num_trials, steps=args.steps, seed=args.seed),
        steps=args.steps,
        num_trials=args.num_trials,
        seed=args.seed,
        max_lines=args.max_lines,
    )
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "explain",
        help="show what a search space shares, before training anything",
        description="Plan every trial of SPACE.py in memory and print trials, root keys, "
        "total and unique steps, the merge rate and the stage tree.",
    )
    p.add_argument(
        "space",
        metavar="SPACE.py",
        help="file defining `space`, and `steps` unless --steps is given",
    )
    p.add_argument("--steps", type=positive, help="steps per trial (overrides the file)")
    p.add_argument("--num-trials", type=positive, help="trials of a random space")
    p.add_argument("--seed", type=int, help="seed of a random space (overrides the file)")
    p.add_argument(
        "--max-lines", type=positive, default=60, help="stage-tree lines to print (default 60)"
    )
    p.set_defaults(handler=_cmd_explain)
