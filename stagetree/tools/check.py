"""Is a trainer exact? :func:`check_trainer` and ``stagetree check SCRIPT.py``.

stagetree hands a trial the model of a shared stage: trained by another trial, split at
a branch step, written to a checkpoint, restored into a fresh instance on another
worker, evaluated at other steps. That is only right when the trainer is *exact*
(DESIGN.md, "Semantics"): trained that way it produces bit for bit what it produces
trained alone. A trainer that forgets a piece of state (the natural mistake: the global
torch RNG used by dropout) silently gives shared results that differ from training
alone. :func:`check_trainer` tells, in seconds, by training a few steps several ways in
this process, on the CPU or wherever the trainer puts itself:

* **straight**: one instance, ``steps`` steps, ``evaluate()`` only at the end;
* **straight, evaluated**: one instance, ``evaluate()`` after every step;
* **split**: ``evaluate()`` after every step, and at every split step the state is
  written through stagetree's real checkpoint format
  (:class:`~stagetree.checkpoints.CheckpointStore` in a temporary directory), read
  back, and loaded into a *fresh* instance built from the same config, with the global
  torch / numpy / python RNGs set to other values first (as in another worker
  process). The fresh instance gets every sequence value before its first step and
  only the changed ones afterwards, as a worker gives them.

Metrics (``evaluate()``) and ``state_dict()`` after every step must agree bit for bit
between the runs (what ``train()`` returns is not compared: it may hold timings). When
they do not, the report names the first step that differs and, where it can tell, why:

* a global RNG (torch / numpy / python) that ``train()`` draws from but that a restore
  does not bring back (neither the state nor ``load_state_dict`` restore it);
* ``evaluate()`` leaving a trace: keys of the state or attributes of the trainer that it
  changes (e.g. a module left in eval mode), global RNGs it advances;
* a state that does not survive the checkpoint format, named by its path
  (``state['sched']['fn']``: a set, a function, an arbitrary object; a ``state_dict()``
  that returns None), a state that reads back different, or a ``load_state_dict`` that
  does not restore what ``state_dict`` saved;
* ``__init__`` that is not deterministic given the config;
* otherwise, the state keys that differ between the straight and the split run.

``stagetree check SCRIPT.py`` loads the script like ``stagetree run`` (the ``Study``
named ``study``, or the only one) and checks its trainer on the first trial of the
tuner's space (the ``Tuner`` named ``tuner``, or the only one; else a space named
``space``; else no sequences). ``stagetree run`` does a short check (2 steps, one split)
the first time it meets a trainer version on a storage, and warns when it fails.
"""

from __future__ import annotations

import math
import random
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stagetree.checkpoints import CheckpointStore
from stagetree.exceptions import CheckpointError, InvalidTrialError, TrainerError, TunerError
from stagetree.executors.worker import _same, evaluate_metrics, snapshot_state
from stagetree.hp import as_sequence
from stagetree.names import (
    _ObservedHp,
    accepted_hyperparameters,
    check_hp_names,
    check_metric_name,
)
from stagetree.study import Study
from stagetree.tools.scripts import loaded_script, pick, values_of
from stagetree.trainer import Trainer
from stagetree.tuners.base import Tuner

__all__ = ["CheckReport", "StepComparison", "check_trainer"]

RNG_NAMES = ("torch", "numpy", "python")
_MAX_PATHS = 4

_RNG_FIX = {
    "torch": "save torch.get_rng_state() in state_dict() and put it back with "
    "torch.set_rng_state() in load_state_dict() (or draw from a torch.Generator of your "
    "own that you checkpoint, or subclass stagetree.torch.TorchTrainer, which does it)",
    "numpy": "save np.random.get_state() in state_dict() and put it back with "
    "np.random.set_state() in load_state_dict() (better: draw from a "
    "np.random.Generator of your own and checkpoint its bit_generator.state)",
    "python": "save random.getstate() in state_dict() and put it back with "
    "random.setstate() in load_state_dict() (better: a random.Random of your own)",
}
_RNG_LABEL = {
    "torch": "the global torch RNG (torch.rand*, dropout, torch.randperm...)",
    "numpy": "numpy's global RNG (np.random.*)",
    "python": "python's global RNG (random.*)",
}


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class StepComparison:
    """One step of the straight run (evaluated after every step) against the split run.

    Attributes:
        step: metrics and state after this many ``train()`` calls.
        straight: ``evaluate()`` of the straight run.
        split: ``evaluate()`` of the split run (None: it did not get this far).
        state_diff: paths in the state where the two runs differ.
    """

    step: int
    straight: dict[str, float]
    split: dict[str, float] | None
    state_diff: tuple[str, ...] = ()

    @property
    def same(self) -> bool:
        """Metrics and state agree bit for bit."""
        return (
            self.split is not None
            and _same_metrics(self.straight, self.split)
            and not self.state_diff
        )


@dataclass(frozen=True)
class CheckReport:
    """What :func:`check_trainer` found.

    Attributes:
        trainer: the trainer's qualified name.
        steps: steps trained per run.
        splits: steps at which the split run restored a fresh instance.
        exact: every run agreed bit for bit (metrics and states) and every restore worked.
        first_divergence: the first step whose metrics or state differ between runs (or
            where a restore failed); None when exact.
        findings: human-readable diagnoses, the most specific first.
        comparisons: metrics per step, straight against split.
        notes: warnings that do not bear on exactness (a sequence ``setup`` never
            reads, for a trainer that does not declare its hyper-parameter names).
        metric_names: the metric names the trainer returned (``evaluate()``'s and
            ``train()``'s), sorted.
    """

    trainer: str
    steps: int
    splits: tuple[int, ...]
    exact: bool
    first_divergence: int | None
    findings: tuple[str, ...]
    comparisons: tuple[StepComparison, ...] = field(default=())
    notes: tuple[str, ...] = ()
    metric_names: tuple[str, ...] = ()

    def format(self) -> str:
        """The report as ``stagetree check`` prints it."""
        where = ", ".join(map(str, self.splits)) if self.splits else "none"
        lines = [
            f"check of {self.trainer}: {self.steps} steps straight through, and split at "
            f"steps {where} (checkpoint round-trip, fresh instance, other global RNGs)"
        ]
        rows = [("step", "straight", "split", "")]
        for c in self.comparisons:
            differs = not c.same
            if c.split is None:
                split_text, mark = "(not reached)", "<- differs"
            elif differs and _same_metrics(c.straight, c.split):
                split_text, mark = "same metrics", "<- state differs"
            elif differs:
                split_text, mark = _metrics_text(c.split, exact=True), "<- differs"
            else:
                split_text, mark = "same", ""
            rows.append((str(c.step), _metrics_text(c.straight, exact=differs), split_text, mark))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for r in rows:
            lines.append(
                f"  {r[0]:>{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip()
            )
        if self.exact:
            lines.append("EXACT: shared stages give this trainer what training alone gives.")
        else:
            lines.append(
                f"NOT EXACT: first difference at step {self.first_divergence}. Shared "
                "results would differ from training alone:"
            )
            lines.extend(f"  - {f}" for f in self.findings)
        if self.notes:
            lines.append("Notes (not about exactness):")
            lines.extend(f"  - {n}" for n in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _metrics_text(metrics: Mapping[str, float], exact: bool = False) -> str:
    if not metrics:
        return "{}"
    return " ".join(f"{k}={v!r}" if exact else f"{k}={v:.6g}" for k, v in metrics.items())


def _same_metrics(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    if a is None or b is None:
        return a is b
    return set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- global RNGs


def _torch() -> Any:
    return sys.modules.get("torch")


def _capture() -> dict[str, Any]:
    out: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state()}
    torch = _torch()
    if torch is not None:
        out["torch"] = torch.random.get_rng_state()
    return out


def _restore_rng(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch = _torch()
    if torch is not None and "torch" in state:
        torch.random.set_rng_state(state["torch"])


def _perturb(k: int) -> None:
    """Put every global RNG somewhere no run of this check has been."""
    seed = 0x5EED + 7919 * (k + 2)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch = _torch()
    if torch is not None:
        torch.manual_seed(seed)


def _rng_changed(a: Mapping[str, Any], b: Mapping[str, Any]) -> set[str]:
    """Names of the global RNGs whose state differs between captures ``a`` and ``b``."""
    changed = set()
    for name in RNG_NAMES:
        if name in a and name in b and not _equal(a[name], b[name]):
            changed.add(name)
    return changed


# --------------------------------------------------------------------------- comparing


def _tensor_bytes(t: Any) -> bytes:
    torch = _torch()
    flat = t.detach().cpu().reshape(-1).contiguous()
    try:
        return bytes(flat.view(torch.uint8).numpy().tobytes())
    except (RuntimeError, TypeError):  # sparse, quantized...: compare values
        return repr(flat.tolist()).encode()


def _equal(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of state leaves (NaN equals NaN; types must agree)."""
    torch = _torch()
    if torch is not None and (isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and _tensor_bytes(a) == _tensor_bytes(b)
        )
    if isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic)):
        if type(a) is not type(b) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype.hasobject:
            return bool(np.array_equal(a, b))
        return bool(a.tobytes() == b.tobytes())
    if isinstance(a, tuple) and isinstance(b, tuple):  # e.g. numpy's RNG state
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    try:
        return bool(a == b)
    except Exception:
        return a is b


class _Container:
    """Marks a container in a flattened state (its kind and size)."""

    __slots__ = ("kind", "size")

    def __init__(self, kind: str, size: int) -> None:
        self.kind = kind
        self.size = size

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Container) and (self.kind, self.size) == (
            other.kind,
            other.size,
        )

    def __hash__(self) -> int:
        return hash((self.kind, self.size))

    def __repr__(self) -> str:
        return f"a {self.kind} of {self.size}"


def _flatten(obj: Any, path: str, out: dict[str, Any]) -> None:
    if isinstance(obj, Mapping):
        out[path] = _Container("dict", len(obj))
        for k, v in obj.items():
            _flatten(v, f"{path}[{k!r}]", out)
    elif isinstance(obj, (list, tuple)):
        out[path] = _Container(type(obj).__name__, len(obj))
        for i, v in enumerate(obj):
            _flatten(v, f"{path}[{i}]", out)
    else:
        out[path] = obj


_ABSENT = object()


def _diff(a: Any, b: Any) -> list[str]:
    """Paths (``state['model']['0.weight']``) where two states differ."""
    fa: dict[str, Any] = {}
    fb: dict[str, Any] = {}
    _flatten(a, "state", fa)
    _flatten(b, "state", fb)
    paths = list(fa) + [p for p in fb if p not in fa]
    out: list[str] = []
    for p in paths:
        x, y = fa.get(p, _ABSENT), fb.get(p, _ABSENT)
        # Only the outermost differing path of a subtree: a changed container size
        # already says that the entries below it differ.
        if (x is _ABSENT or y is _ABSENT or not _equal(x, y)) and not any(
            p.startswith(q) and p != q for q in out
        ):
            out.append(p)
    return out


def _paths_text(paths: list[str] | tuple[str, ...]) -> str:
    shown = ", ".join(paths[:_MAX_PATHS])
    more = len(paths) - _MAX_PATHS
    return shown + (f" and {more} more" if more > 0 else "")


def _leaf_kind(state: Any, path: str) -> str:
    flat: dict[str, Any] = {}
    _flatten(state, "state", flat)
    value = flat.get(path, _ABSENT)
    if value is _ABSENT:
        return "nothing"
    if isinstance(value, _Container):
        return repr(value)
    return f"a {type(value).__module__}.{type(value).__qualname__}".replace("builtins.", "")


def _fingerprint(obj: Any, depth: int = 0) -> Any:
    """Something comparable that changes when ``obj`` (an attribute) changes."""
    torch = _torch()
    if obj is None or isinstance(obj, (bool, int, str, bytes)):
        return obj
    if isinstance(obj, float):
        return "nan" if math.isnan(obj) else obj
    if torch is not None:
        if isinstance(obj, torch.Tensor):
            return ("T", str(obj.dtype), tuple(obj.shape), _tensor_bytes(obj))
        if isinstance(obj, torch.nn.Module):
            modes = tuple(m.training for m in obj.modules())
            return ("M", modes, _fingerprint(obj.state_dict(), depth + 1))
        if isinstance(obj, torch.Generator):
            return ("G", _tensor_bytes(obj.get_state()))
    if isinstance(obj, np.ndarray):
        data = repr(obj) if obj.dtype.hasobject else obj.tobytes()
        return ("A", obj.dtype.str, obj.shape, data)
    if isinstance(obj, np.random.Generator):
        return ("g", repr(obj.bit_generator.state))
    if isinstance(obj, np.random.RandomState):
        return ("r", _fingerprint(obj.get_state(), depth + 1))
    if isinstance(obj, random.Random):
        return ("p", obj.getstate())
    if depth > 4 or isinstance(obj, type) or callable(obj):
        return ("?",)
    if isinstance(obj, Mapping):
        return ("D", tuple((repr(k), _fingerprint(v, depth + 1)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return ("L", tuple(_fingerprint(v, depth + 1) for v in obj))
    if isinstance(obj, (set, frozenset)):
        return ("S", tuple(sorted(map(repr, obj))))
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict) and callable(getattr(obj, "load_state_dict", None)):
        try:
            return ("O", _fingerprint(state_dict(), depth + 1))
        except Exception:
            return ("?",)
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict):
        return ("V", type(obj).__qualname__, _fingerprint(attributes, depth + 1))
    return ("?",)


def _attributes(trainer: Any) -> dict[str, Any]:
    return {k: _fingerprint(v) for k, v in vars(trainer).items() if not k.startswith("__")}


def _module_modes_changed(before: Any, after: Any) -> bool:
    return (
        isinstance(before, tuple)
        and isinstance(after, tuple)
        and before[:1] == ("M",) == after[:1]
        and before[1] != after[1]
    )


# --------------------------------------------------------------------------- runs


class _UserError(Exception):
    """Trainer code raised during a run."""

    def __init__(self, what: str, step: int, error: BaseException) -> None:
        super().__init__(f"{what} raised at step {step}: {type(error).__name__}: {error}")
        self.what = what
        self.step = step
        self.error = error
        self.tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))


@dataclass
class _Trace:
    states: dict[int, Any] = field(default_factory=dict)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    rng_before: dict[int, dict[str, Any]] = field(default_factory=dict)
    train_draws: set[str] = field(default_factory=set)
    eval_draws: dict[str, int] = field(default_factory=dict)
    eval_state: dict[str, int] = field(default_factory=dict)
    eval_attrs: dict[str, tuple[int, bool]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)
    returned: set[str] = field(default_factory=set)  # metric names train() returned
    stopped: int | None = None


class _Driver:
    def __init__(
        self,
        cls: type[Trainer],
        config: Mapping[str, Any],
        values: list[dict[str, Any]],
        store: CheckpointStore,
    ) -> None:
        self.cls = cls
        self.config = dict(config)
        self.values = values
        self.steps = len(values)
        self.store = store
        self.name = cls.__name__

    def _call(self, fn: Callable[..., Any], what: str, step: int, *args: Any) -> Any:
        try:
            return fn(*args)
        except TrainerError:
            raise
        except Exception as exc:
            raise _UserError(f"{self.name}.{what}", step, exc) from exc

    def _state(self, trainer: Trainer, step: int) -> Any:
        return snapshot_state(self._call(trainer.state_dict, "state_dict()", step))

    def run(self, evaluate_at: set[int], splits: set[int], perturb: bool, watch: bool) -> _Trace:
        trace = _Trace()
        trainer = self._call(self.cls, "__init__", 0, self.config)
        trace.states[0] = self._state(trainer, 0)
        given: dict[str, Any] = {}
        for t in range(self.steps):
            if t in splits:
                restored = self._restore(trace, t, perturb, evaluate_at)
                if restored is None:
                    trace.stopped = t
                    return trace
                trainer = restored
                given = {}
            values = self.values[t]
            change = {k: v for k, v in values.items() if k not in given or not _same(given[k], v)}
            observed = None
            if change:
                given.update(change)
                if watch and t == 0 and accepted_hyperparameters(self.cls) is None:
                    change = observed = _ObservedHp(change)
                self._call(trainer.setup, "setup()", t, change)
            trace.rng_before[t] = before = _capture()
            out = self._call(trainer.train, "train()", t)
            if isinstance(out, Mapping):
                trace.returned.update(map(str, out))
            if observed is not None:
                trace.unread = sorted(set(dict.keys(observed)) - observed.read)
            trace.train_draws |= _rng_changed(before, _capture())
            step = t + 1
            trace.states[step] = self._state(trainer, step)
            if step in evaluate_at and step not in splits:
                trace.metrics[step] = self._evaluate(trainer, trace, step, watch)
        return trace

    def _evaluate(
        self, trainer: Trainer, trace: _Trace, step: int, watch: bool
    ) -> dict[str, float]:
        if not watch:
            return self._call(evaluate_metrics, "evaluate()", step, trainer)
        attrs = _attributes(trainer)
        rng = _capture()
        metrics = self._call(evaluate_metrics, "evaluate()", step, trainer)
        for name in _rng_changed(rng, _capture()):
            trace.eval_draws.setdefault(name, step)
        for path in _diff(trace.states[step], self._state(trainer, step)):
            trace.eval_state.setdefault(path, step)
        after = _attributes(trainer)
        for name in sorted(set(attrs) | set(after)):
            if attrs.get(name, _ABSENT) != after.get(name, _ABSENT):
                modes = _module_modes_changed(attrs.get(name), after.get(name))
                trace.eval_attrs.setdefault(name, (step, modes))
        return metrics

    def _restore(
        self, trace: _Trace, step: int, perturb: bool, evaluate_at: set[int]
    ) -> Trainer | None:
        """Round-trip the state of ``step`` through a checkpoint into a fresh trainer."""
        state = trace.states[step]
        if not isinstance(state, Mapping):
            trace.problems.append(
                f"{self.name}.state_dict() returned "
                + ("None" if state is None else f"{_leaf_kind(state, 'state')} ({state!r:.60})")
                + "; it must return a dict of everything that shapes training"
            )
            return None
        try:
            ref = self.store.save(f"check-{step}-{id(trace)}", state).ref
            loaded = self.store.load(ref)
            self.store.delete(ref)
        except CheckpointError as exc:
            message = str(exc).removeprefix(
                f"cannot write checkpoint check-{step}-{id(trace)}.ckpt: "
            )
            trace.problems.append(
                f"the state after step {step} cannot be written as a stagetree checkpoint: "
                f"{message} (save a set as a sorted list, an object as its own state "
                "dict, a function not at all)"
            )
            return None
        changed = _diff(state, loaded)
        if changed:
            path = changed[0]
            trace.problems.append(
                f"the state does not survive the checkpoint format: {_paths_text(changed)} "
                f"(saved {_leaf_kind(state, path)}, read back {_leaf_kind(loaded, path)})"
            )
        if perturb:
            _perturb(step)
        try:
            trainer = self._call(self.cls, "__init__", step, self.config)
            self._call(trainer.load_state_dict, "load_state_dict()", step, loaded)
        except _UserError as exc:
            trace.problems.append(
                f"restoring a fresh instance from the checkpoint of step {step} failed: {exc}"
            )
            return None
        again = self._state(trainer, step)
        lost = _diff(loaded, again)
        if lost and not any("does not restore" in p for p in trace.problems):
            trace.problems.append(
                f"{self.name}.load_state_dict() does not restore what state_dict() saved: "
                f"right after a restore at step {step}, state_dict() differs at "
                f"{_paths_text(lost)}"
            )
        if step in evaluate_at:
            trace.metrics[step] = self._evaluate(trainer, trace, step, watch=False)
        return trainer


# --------------------------------------------------------------------------- the check


def _default_splits(steps: int) -> tuple[int, ...]:
    if steps <= 12:
        return tuple(range(1, steps))
    return tuple(sorted({max(1, round(i * steps / 8)) for i in range(1, 8)}))


def _first_state_divergence(a: _Trace, b: _Trace, steps: int) -> tuple[int, list[str]] | None:
    for step in range(1, steps + 1):
        if step not in a.states or step not in b.states:
            return None
        paths = _diff(a.states[step], b.states[step])
        if paths:
            return step, paths
    return None


def check_trainer(
    trainer_cls: type[Trainer],
    config: Mapping[str, Any],
    hp: Mapping[str, Any],
    steps: int,
    *,
    splits: Any = None,
) -> CheckReport:
    """Check that ``trainer_cls`` is exact: shared stages give what training alone gives.

    Trains ``steps`` steps of the trial ``(config, hp)`` straight through, straight
    with ``evaluate()`` after every step, and split at ``splits`` with a checkpoint
    round-trip through stagetree's checkpoint format into a fresh instance (see the
    module documentation), then compares metrics and states bit for bit. The global
    RNGs of this process are left as they were.

    Args:
        trainer_cls: the :class:`~stagetree.Trainer` subclass.
        config: fixed hyper-parameters, as ``Trainer(config)`` receives them.
        hp: sequences by name (or plain values, as for ``Study.submit``).
        steps: steps per run (>= 2; a few are enough).
        splits: steps at which the split run restores (in ``1 .. steps - 1``); default:
            every step up to 12 steps, else 7 spread over the run.

    Returns:
        The :class:`CheckReport`.

    Raises:
        InvalidTrialError: bad arguments.
        TrainerError: trainer code raised outside a restore (the trainer does not run
            at all), or ``evaluate()`` did not return a dict of numbers.
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise InvalidTrialError(f"trainer_cls must be a Trainer subclass, got {trainer_cls!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise InvalidTrialError(f"steps must be an int >= 2, got {steps!r}")
    split_steps = _default_splits(steps) if splits is None else tuple(sorted(set(splits)))
    if not split_steps or any(
        isinstance(s, bool) or not isinstance(s, int) or not 1 <= s < steps for s in split_steps
    ):
        raise InvalidTrialError(f"splits must be steps in [1, {steps - 1}], got {splits!r}")
    seqs = {str(k): as_sequence(v) for k, v in hp.items()}
    check_hp_names(trainer_cls, seqs)
    values = [{name: seq(t) for name, seq in seqs.items()} for t in range(steps)]
    everything = set(range(1, steps + 1))
    outer = _capture()
    try:
        with tempfile.TemporaryDirectory(prefix="stagetree-check-") as tmp:
            driver = _Driver(trainer_cls, config, values, CheckpointStore(tmp))
            start = _capture()
            try:
                _restore_rng(start)
                plain = driver.run({steps}, set(), perturb=False, watch=False)
                _restore_rng(start)
                again = driver.run({steps}, set(), perturb=False, watch=False)
                _restore_rng(start)
                straight = driver.run(everything, set(), perturb=False, watch=True)
                _restore_rng(start)
                split = driver.run(everything, set(split_steps), perturb=True, watch=False)
                unperturbed = None
                if _diverges(straight, split, steps):
                    _restore_rng(start)
                    unperturbed = driver.run(
                        everything, set(split_steps), perturb=False, watch=False
                    )
                _perturb(-1)
                other = driver._state(driver._call(trainer_cls, "__init__", 0, config), 0)
            except _UserError as exc:
                raise TrainerError(
                    f"{exc} (while checking {trainer_cls.__name__})", exc.tb
                ) from None
    finally:
        _restore_rng(outer)
    return _report(
        trainer_cls.__name__,
        steps,
        split_steps,
        _Runs(plain, again, straight, split, unperturbed),
        other,
    )


def _diverges(a: _Trace, b: _Trace, steps: int) -> bool:
    if b.stopped is not None or b.problems:
        return True
    for step in range(1, steps + 1):
        if not _same_metrics(a.metrics.get(step), b.metrics.get(step)):
            return True
    # What train() returns counts only with the state: it may hold a timing.
    return _first_state_divergence(a, b, steps) is not None


def _first_metric_divergence(a: _Trace, b: _Trace, steps: int) -> int | None:
    for step in range(1, steps + 1):
        ma, mb = a.metrics.get(step), b.metrics.get(step)
        if ma is not None and mb is not None and not _same_metrics(ma, mb):
            return step
    return None


@dataclass
class _Runs:
    plain: _Trace  # straight, evaluated at the end only
    again: _Trace  # the same once more: is training deterministic at all?
    straight: _Trace  # straight, evaluated after every step
    split: _Trace  # split, other global RNGs at every restore
    unperturbed: _Trace | None  # split, global RNGs left alone (when split diverged)


def _report(name: str, steps: int, splits: tuple[int, ...], runs: _Runs, other: Any) -> CheckReport:
    plain, straight, split, unperturbed = runs.plain, runs.straight, runs.split, runs.unperturbed
    findings: list[str] = []
    divergences: list[int] = []
    everything = range(1, steps + 1)
    metric_names = tuple(
        sorted(set(straight.returned).union(*(m.keys() for m in straight.metrics.values())))
    )
    noise = _first_state_divergence(plain, runs.again, steps)
    if noise is not None or not _same_metrics(plain.metrics[steps], runs.again.metrics[steps]):
        step, paths = noise if noise is not None else (steps, [])
        where = f" at {_paths_text(paths)}" if paths else " in their metrics"
        rows = [StepComparison(s, straight.metrics[s], split.metrics.get(s)) for s in everything]
        return CheckReport(
            trainer=name,
            steps=steps,
            splits=splits,
            exact=False,
            first_divergence=step,
            findings=(
                f"training is not deterministic: two identical straight runs in this process "
                f"differ after step {step}{where}, so nothing else can be checked. Use "
                "deterministic algorithms (stagetree.torch.deterministic(), "
                "torch.use_deterministic_algorithms(True); on a GPU also "
                "CUBLAS_WORKSPACE_CONFIG=:4096:8) and seed every generator from the config",
                *dict.fromkeys(split.problems),
            ),
            comparisons=tuple(rows),
            metric_names=metric_names,
        )

    # The split run against the straight run (both evaluated after every step).
    comparisons = []
    for step in range(1, steps + 1):
        state_diff: tuple[str, ...] = ()
        if step in split.states:
            state_diff = tuple(_diff(straight.states[step], split.states[step]))
        comparisons.append(
            StepComparison(step, straight.metrics[step], split.metrics.get(step), state_diff)
        )
    split_diverges = _diverges(straight, split, steps)
    if split_diverges:
        first = [c.step for c in comparisons if not c.same]
        metric_step = _first_metric_divergence(straight, split, steps)
        if metric_step is not None:
            first.append(metric_step)
        if split.stopped is not None:
            first.append(split.stopped)
        if first:
            divergences.append(min(first))
        findings.extend(dict.fromkeys(split.problems))
        restores = [s for s in splits if split.stopped is None or s < split.stopped]
        for rng in RNG_NAMES:
            if rng not in straight.train_draws:
                continue
            lost = [
                s
                for s in restores
                if s in split.rng_before
                and rng in split.rng_before[s]
                and not _equal(split.rng_before[s][rng], straight.rng_before[s][rng])
            ]
            if lost:
                findings.append(
                    f"train() draws from {_RNG_LABEL[rng]}, and a restore does not bring "
                    f"it back: after the restore at step {lost[0]} the next step starts "
                    "from whatever state the worker process's global RNG is in. Fix: "
                    + _RNG_FIX[rng]
                )
        if (
            unperturbed is not None
            and not _diverges(straight, unperturbed, steps)
            and not any("global" in f for f in findings)
        ):
            findings.append(
                "with the process's global RNGs left as they were the split run is "
                "exact, with other values it is not: training depends on global RNG "
                "state (torch, numpy, python, CUDA) that the checkpoint does not hold"
            )
        found = _first_state_divergence(straight, split, steps)
        if found is not None:
            step, paths = found
            findings.append(
                f"after step {step} the state of the split run differs from the straight "
                f"run's at {_paths_text(paths)}"
            )
        elif not split.problems and not any("global" in f for f in findings):
            findings.append(
                "the states agree at every step but the metrics do not: something that "
                "shapes training or evaluation is not in state_dict() (an attribute the "
                "state leaves out, a global)"
            )

    # Evaluating after every step against evaluating only at the end.
    eval_first = None
    found = _first_state_divergence(plain, straight, steps)
    if found is not None:
        eval_first = found[0]
    if not _same_metrics(plain.metrics[steps], straight.metrics[steps]):
        eval_first = min(eval_first or steps, steps)
    if eval_first is not None:
        divergences.append(eval_first)
        causes = []
        if straight.eval_state:
            paths = list(straight.eval_state)
            causes.append(f"it changes the state at {_paths_text(paths)}")
        attrs = [
            f"{a} (train/eval mode)" if modes else a
            for a, (_, modes) in straight.eval_attrs.items()
        ]
        if attrs:
            causes.append(f"it changes the attribute(s) {_paths_text(attrs)} of the trainer")
        draws = [r for r in straight.eval_draws if r in straight.train_draws]
        if draws:
            causes.append(
                "it advances "
                + " and ".join(_RNG_LABEL[r] for r in draws)
                + ", which train() draws from too"
            )
        text = "; ".join(causes) if causes else "stagetree could not tell how"
        findings.append(
            f"evaluate() leaves a trace on training: trained with evaluate() after every "
            f"step, the trainer differs from step {eval_first} on from the same trainer "
            f"evaluated only at the end: {text}. evaluate() must not change modes, RNGs, "
            "data positions or anything else training sees (restore what it changes, or "
            "subclass stagetree.torch.TorchTrainer, whose evaluate() is trace-free)"
        )

    # Construction must depend on the config only.
    init_diff = _diff(plain.states[0], other)
    if init_diff:
        divergences.append(0)
        findings.append(
            f"__init__ is not deterministic given the config: two instances built with "
            f"other global RNG states differ at {_paths_text(init_diff)} before any "
            "training (seed every generator from the config, e.g. "
            "torch.manual_seed(config['seed']), or draw from generators of your own)"
        )
    exact = not divergences and not findings
    notes = []
    if straight.unread:
        notes.append(
            f"sequential hyper-parameter(s) {straight.unread} reached {name}.setup() but "
            "were never read in the first step: a typo trains with the default value"
        )
    return CheckReport(
        trainer=name,
        steps=steps,
        splits=splits,
        exact=exact,
        first_divergence=min(divergences) if divergences else None,
        findings=tuple(dict.fromkeys(findings)),
        comparisons=tuple(comparisons),
        notes=tuple(notes),
        metric_names=metric_names,
    )


# --------------------------------------------------------------------------- scripts

#: Steps and split of the check ``stagetree run`` does on first contact with a trainer.
QUICK_STEPS = 2
_CHECKED = "checked"
_METRIC = "metric:"  # + a metric name the check saw returned


def first_trial(space: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config, hp)`` of the first trial of a space: a random space's first sample
    (seed 0), a grid's first trial, or the first item of a list of trial specs.

    Raises:
        InvalidTrialError: the space has no trial.
    """
    if space is None:
        return {}, {}
    if hasattr(space, "sample"):
        spec = next(iter(space.sample(1, 0)), None)
    else:  # a grid (iterated lazily: it may be huge) or a list of trial specs
        spec = next(iter(space), None)
    if spec is None:
        raise InvalidTrialError("the search space has no trials")
    return dict(spec.config), dict(spec.hp)


def _check_scope(study: Any) -> str:
    return f"check:{study.version}"


def first_contact_check(study: Any, tuner: Any, out: Any) -> CheckReport | None:
    """The check ``stagetree run`` does before tuning: once per trainer version and
    storage (remembered in the storage's counters, with the metric names the trainer
    returned), :data:`QUICK_STEPS` steps of the tuner's first trial with one split; a
    report that is not exact is printed to ``out`` as a warning. Returns the report,
    None when nothing was checked.

    What would fail every trial stops the run here, before any worker starts.

    Raises:
        TrainerError: the trainer raised on the tuner's first trial (a missing
            ``state_dict``, a config key ``__init__`` does not find...).
        TunerError: the tuner's metric is not among those the trainer returns.
    """
    if study.settings.executor == "simulated":
        return None
    engine = study._engine
    scope = _check_scope(study)
    metric = getattr(tuner, "metric", None)
    with engine.reading() as storage:
        seen = storage.stats(scope)
    if seen.get(_CHECKED):
        known = [k.removeprefix(_METRIC) for k in seen if k.startswith(_METRIC)]
        if known and isinstance(metric, str):
            check_metric_name(study.trainer, metric, known)
        return None
    config, hp = first_trial(getattr(tuner, "space", None))
    name = study.trainer.__name__
    try:
        report = check_trainer(study.trainer, config, hp, QUICK_STEPS, splits=(1,))
    except TrainerError as exc:
        raise TrainerError(
            f"{name} fails on the first trial of the tuner's space, so every trial "
            f"would fail; nothing was trained: {exc.args[0]} (`--no-check` skips this "
            "check)",
            exc.traceback,
        ) from None
    if isinstance(metric, str):
        try:
            check_metric_name(study.trainer, metric, report.metric_names)
        except TunerError as exc:
            raise TunerError(
                f"{exc} in {QUICK_STEPS} steps of the first trial of the tuner's space; "
                "nothing was trained (`--no-check` skips this check)"
            ) from None
    engine.add_stats(
        scope,
        **{_CHECKED: 1.0, "exact": float(report.exact)},
        **{_METRIC + m: 1.0 for m in report.metric_names},
    )
    if not report.exact:
        print(
            f"stagetree: warning: {name} is not exact: trials that share stages will get "
            "results that differ from training alone.\n"
            + report.format()
            + "\n(checked once per trainer version and storage; `stagetree check SCRIPT.py` "
            "checks longer)",
            file=out,
        )
    return report


def check_script(
    script: Any,
    *,
    steps: int = 4,
    splits: Any = None,
    out: Any = None,
) -> CheckReport:
    """``stagetree check``: check the trainer of the study a script defines.

    The script is loaded as ``stagetree run`` loads it (nothing is trained or written
    by loading; the study's storage is not opened). The trainer is the one of the
    ``Study`` named ``study`` (or the only one); the trial checked is the first of the
    space of the ``Tuner`` named ``tuner`` (or the only one), else of a space named
    ``space``, else a trial without sequences and with an empty config.

    Raises:
        CommandError: no such script, or it defines no study.
    """
    stream = sys.stdout if out is None else out
    studies: list[Any] = []
    with loaded_script(script) as namespace:
        try:
            studies = values_of(namespace, Study)
            study = pick(namespace, "study", Study, "study", str(script))
            tuners = values_of(namespace, Tuner)
            if "tuner" in namespace and isinstance(namespace["tuner"], Tuner):
                space = getattr(namespace["tuner"], "space", None)
            elif len(tuners) == 1:
                space = getattr(tuners[0], "space", None)
            else:
                space = namespace.get("space")
            config, hp = first_trial(space)
            report = check_trainer(study.trainer, config, hp, steps, splits=splits)
        finally:
            for st in studies:
                st.close()
    print(report.format(), file=stream)
    return report
