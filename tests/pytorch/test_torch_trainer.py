"""Exactness of TorchTrainer: a trial split at any steps trains bit for bit like one run.

Real training on CPU: an MLP with dropout on scikit-learn digits (stagetree.torch.examples),
one thread, deterministic algorithms.
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest

pytest.importorskip("torch")

import torch

pytest.importorskip("sklearn")

import numpy as np

from stagetree.exceptions import CheckpointError
from stagetree.torch import StageLoader, TorchTrainer, deterministic
from stagetree.torch.examples import DigitsTrainer

pytestmark = pytest.mark.torch

Schedule = Callable[[int], dict[str, Any]]


@pytest.fixture(autouse=True, scope="module")
def _deterministic() -> Iterator[None]:
    with deterministic(threads=1):
        yield


# -- harness ------------------------------------------------------------------------------


def roundtrip(state: Mapping[str, Any]) -> Any:
    """Through a real checkpoint file format, loaded the safe way."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def disturb_global_rng(salt: int) -> None:
    """What another trial or the worker may have done to the process's generators."""
    torch.manual_seed(1000 + salt)
    np.random.seed(2000 + salt)
    random.seed(3000 + salt)
    torch.rand(7)
    np.random.normal(size=3)
    random.random()


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """Recursive exact equality: tensors by torch.equal (dtype included), rest by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"tensors differ at {path}"
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping) and set(a) == set(b), path
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def run(
    config: Mapping[str, Any],
    schedule: Schedule,
    steps: int,
    *,
    cls: type[TorchTrainer] = DigitsTrainer,
    splits: Sequence[int] = (),
    evaluate_at: Sequence[int] = (),
) -> tuple[TorchTrainer, list[Any], dict[int, Any]]:
    """Train ``steps`` steps following the Trainer contract, restarting at ``splits``.

    Before step t the trainer gets every value of ``schedule(t)`` on its first step and
    after a restore, only the changed values otherwise. At a split the state goes through
    torch.save / torch.load(weights_only=True) into a fresh trainer built in a process
    whose global generators were disturbed. Metrics at step s are evaluate() after s steps.
    """
    trainer = cls(config)
    previous: dict[str, Any] | None = None
    train_metrics: list[Any] = []
    eval_metrics: dict[int, Any] = {}
    for step in range(steps + 1):
        if step in evaluate_at:
            eval_metrics[step] = trainer.evaluate()
        if step == steps:
            break
        if step in splits:
            state = roundtrip(trainer.state_dict())
            del trainer
            disturb_global_rng(step)
            trainer = cls(config)
            trainer.load_state_dict(state)
            previous = None
        values = schedule(step)
        if previous is None:
            trainer.setup(values)
        else:
            trainer.setup({k: v for k, v in values.items() if previous.get(k) != v})
        previous = values
        train_metrics.append(trainer.train())
    return trainer, train_metrics, eval_metrics


def assert_same_training(a: TorchTrainer, b: TorchTrainer) -> None:
    state_a, state_b = a.state_dict(), b.state_dict()
    # Every tensor of every module and of the optimizer state, RNGs and loader cursor.
    assert_same(state_a, state_b)
    assert set(state_a["objects"]) >= {"model", "optimizer", "loader"}


def momentum_schedule(step: int) -> dict[str, Any]:
    """lr drop at 5, momentum change at 7, batch size 32 -> 20 at 3 (mid-epoch)."""
    return {
        "lr": 0.1 if step < 5 else 0.02,
        "momentum": 0.9 if step < 7 else 0.5,
        "batch_size": 32 if step < 3 else 20,
    }


CONFIG = {"hidden": 24, "dropout": 0.3, "optimizer": "momentum", "batches_per_step": 4}
STEPS = 18  # 1348 training samples: with the schedule above epoch 0 ends at step 15


@pytest.fixture(scope="module")
def reference() -> tuple[TorchTrainer, list[Any], dict[int, Any]]:
    return run(CONFIG, momentum_schedule, STEPS, evaluate_at=(0, 4, 9, STEPS))


# -- exactness ------------------------------------------------------------------------------


def test_epoch_boundary_is_crossed_with_a_partial_batch(
    reference: tuple[TorchTrainer, list[Any], dict[int, Any]],
) -> None:
    trainer = reference[0]
    assert isinstance(trainer, DigitsTrainer)
    assert trainer.loader.epoch == 1  # the split tests below cover the epoch change


@pytest.mark.parametrize(
    "splits",
    [(1,), (3,), (4,), (5, 6), (7,), (2, 9, 15, 16), tuple(range(1, STEPS))],
    ids=lambda s: "split@" + "-".join(map(str, s[:4])) + ("..." if len(s) > 4 else ""),
)
def test_split_trial_equals_uninterrupted(
    reference: tuple[TorchTrainer, list[Any], dict[int, Any]], splits: tuple[int, ...]
) -> None:
    ref, ref_train, ref_eval = reference
    trainer, train_metrics, eval_metrics = run(
        CONFIG, momentum_schedule, STEPS, splits=splits, evaluate_at=(0, 4, 9, STEPS)
    )
    assert train_metrics == ref_train
    assert eval_metrics == ref_eval
    assert_same_training(trainer, ref)
    assert trainer.hp == {"lr": 0.02, "momentum": 0.5, "batch_size": 20}
    assert trainer.optimizer.param_groups[0]["momentum"] == 0.5  # type: ignore[attr-defined]


def test_schedule_changes_matter(
    reference: tuple[TorchTrainer, list[Any], dict[int, Any]],
) -> None:
    """Guard against a harness in which setup values never reach the optimizer/loader."""
    _, ref_train, _ = reference
    for changed in (
        lambda s: {**momentum_schedule(s), "lr": 0.1},
        lambda s: {**momentum_schedule(s), "momentum": 0.9},
        lambda s: {**momentum_schedule(s), "batch_size": 32},
    ):
        _, train_metrics, _ = run(CONFIG, changed, STEPS)
        assert train_metrics[:3] == ref_train[:3]
        assert train_metrics[-1] != ref_train[-1]


def test_evaluate_leaves_no_trace(
    reference: tuple[TorchTrainer, list[Any], dict[int, Any]],
) -> None:
    ref, ref_train, ref_eval = reference
    trainer, train_metrics, eval_metrics = run(
        CONFIG, momentum_schedule, STEPS, evaluate_at=tuple(range(STEPS + 1))
    )
    quiet, quiet_train, _ = run(CONFIG, momentum_schedule, STEPS)
    assert train_metrics == ref_train == quiet_train
    assert_same_training(trainer, ref)
    assert_same_training(quiet, ref)
    assert {s: eval_metrics[s] for s in ref_eval} == ref_eval
    # Dropout is off in evaluate (eval mode), so it is repeatable; the accuracy is real.
    assert trainer.evaluate() == trainer.evaluate() == ref_eval[STEPS]
    assert ref_eval[STEPS]["accuracy"] > 0.8 > ref_eval[0]["accuracy"]


def adam_schedule(step: int) -> dict[str, Any]:
    return {
        "lr": 0.01 if step < 4 else 0.003,
        "beta1": 0.9 if step < 6 else 0.8,
        "weight_decay": 0.0 if step < 3 else 1e-3,
        "batch_size": 16 if step < 5 else 48,
    }


def test_adam_split_equals_uninterrupted() -> None:
    config = {**CONFIG, "optimizer": "adam", "seed": 11}
    ref, ref_train, ref_eval = run(config, adam_schedule, 10, evaluate_at=(3, 10))
    trainer, train_metrics, eval_metrics = run(
        config, adam_schedule, 10, splits=(2, 5, 6, 9), evaluate_at=(3, 10)
    )
    assert train_metrics == ref_train and eval_metrics == ref_eval
    assert_same_training(trainer, ref)
    assert trainer.optimizer.param_groups[0]["betas"] == (0.8, 0.999)  # type: ignore[attr-defined]


class NoisyDigits(DigitsTrainer):
    """Draws from every kind of generator inside train(): global torch, numpy, python, and
    generator objects held as attributes; keeps a plain counter through extra_state."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.np_rng = np.random.default_rng(5)
        self.py_rng = random.Random(6)
        self.torch_rng = torch.Generator().manual_seed(7)
        self.batches_seen = 0

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        self.batches_seen += 1
        noise = torch.from_numpy(np.random.normal(0.0, 0.05, size=tuple(x.shape)))
        scale = 1.0 + 0.1 * random.random() + 0.05 * self.py_rng.random()
        shift = float(self.np_rng.normal()) * 0.01
        jitter = torch.rand(x.shape, generator=self.torch_rng) * 0.01 + torch.rand(1) * 0.01
        return x * scale + noise.float() + shift + jitter

    def extra_state(self) -> dict[str, Any]:
        return {"batches_seen": self.batches_seen}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.batches_seen = int(state["batches_seen"])


def assert_noisy_splits_exact() -> tuple[TorchTrainer, list[Any]]:
    """A NoisyDigits trial split at several steps trains and evaluates like one run;
    returns the split run's trainer and the training metrics."""
    ref, ref_train, ref_eval = run(
        CONFIG, momentum_schedule, 9, cls=NoisyDigits, evaluate_at=(2, 9)
    )
    trainer, train_metrics, eval_metrics = run(
        CONFIG, momentum_schedule, 9, cls=NoisyDigits, splits=(1, 4, 5, 8), evaluate_at=(2, 9)
    )
    assert train_metrics == ref_train and eval_metrics == ref_eval
    assert_same_training(trainer, ref)
    return trainer, ref_train


def test_rng_use_inside_train_is_exact() -> None:
    trainer, ref_train = assert_noisy_splits_exact()
    state = trainer.state_dict()
    assert set(state["rng_objects"]) == {"np_rng", "py_rng", "torch_rng"}
    assert state["extra"] == {"batches_seen": 36}
    assert isinstance(trainer, NoisyDigits) and trainer.batches_seen == 36
    # The noise is real: without it training differs.
    _, plain_train, _ = run(CONFIG, momentum_schedule, 9)
    assert plain_train != ref_train


def test_global_rng_of_the_caller_is_untouched() -> None:
    disturb_global_rng(1)
    before = (
        torch.get_rng_state(),
        np.random.get_state(legacy=False)["state"]["key"].copy(),
        random.getstate(),
    )
    trainer = NoisyDigits(CONFIG)
    trainer.setup(momentum_schedule(0))
    trainer.train()
    trainer.evaluate()
    trainer.load_state_dict(roundtrip(trainer.state_dict()))
    after = (
        torch.get_rng_state(),
        np.random.get_state(legacy=False)["state"]["key"],
        random.getstate(),
    )
    assert torch.equal(before[0], after[0])
    assert np.array_equal(before[1], after[1])
    assert before[2] == after[2]


def test_construction_depends_on_config_only() -> None:
    disturb_global_rng(2)
    a = DigitsTrainer(CONFIG)
    disturb_global_rng(3)
    b = DigitsTrainer(CONFIG)
    assert_same(a.state_dict(), b.state_dict())
    c = DigitsTrainer({**CONFIG, "seed": 1})
    assert isinstance(a, DigitsTrainer) and isinstance(c, DigitsTrainer)
    assert not torch.equal(a.model.state_dict()["0.weight"], c.model.state_dict()["0.weight"])


def test_interleaved_trainers_equal_separate_runs() -> None:
    config_b = {**CONFIG, "seed": 4, "optimizer": "sgd"}
    ref_a, train_a, _ = run(CONFIG, momentum_schedule, 6, cls=NoisyDigits)
    ref_b, train_b, _ = run(config_b, momentum_schedule, 6, cls=NoisyDigits)
    a, b = NoisyDigits(CONFIG), NoisyDigits(config_b)
    got_a, got_b = [], []
    for step in range(6):
        # Full values each step are allowed too: unchanged values are no-ops.
        a.setup(momentum_schedule(step))
        b.setup(momentum_schedule(step))
        got_a.append(a.train())
        random.random()  # the caller's own draws between steps
        got_b.append(b.train())
    assert got_a == train_a and got_b == train_b
    assert_same_training(a, ref_a)
    assert_same_training(b, ref_b)


def test_one_state_loaded_into_two_trainers() -> None:
    """load_state_dict must not alias the given tensors (optimizers keep what they get)."""
    trainer, _, _ = run(CONFIG, momentum_schedule, 3)
    state = trainer.state_dict()
    first, second = DigitsTrainer(CONFIG), DigitsTrainer(CONFIG)
    first.load_state_dict(state)
    second.load_state_dict(state)
    for t in (first, second):
        t.setup(momentum_schedule(3))
        t.train()
    assert_same_training(first, second)


def test_state_dict_is_a_snapshot_of_plain_values() -> None:
    trainer, _, _ = run(CONFIG, momentum_schedule, 2)
    state = trainer.state_dict()
    kept = roundtrip(state)
    trainer.setup(momentum_schedule(2))
    trainer.train()
    assert_same(state, kept)  # training after state_dict() did not change the snapshot

    def check(value: Any, path: str) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                assert isinstance(key, (str, int)), path
                check(item, f"{path}.{key}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                check(item, f"{path}[{i}]")
        else:
            # None only where PyTorch's own optimizer state has it ("foreach", "fused").
            assert value is None or isinstance(value, (torch.Tensor, bool, int, float, str)), (
                f"{path}: {type(value).__name__}"
            )

    check(state, "state")
    assert state["objects"]["loader"] == {"epoch": 0, "position": 256, "batch_size": 32}
    assert state["modes"]["model"][0] is True


# -- evaluate isolation details --------------------------------------------------------------


class Recorder(DigitsTrainer):
    def evaluate(self) -> dict[str, float]:
        self.seen = (
            torch.is_grad_enabled(),
            self.model.training,
            self.loader.next_indices().tolist(),  # draws data: must be undone
            torch.rand(1).item(),
        )
        self.loader.set_batch_size(3)
        return super().evaluate()


def test_evaluate_restores_modes_loader_and_runs_without_grad() -> None:
    trainer = Recorder(CONFIG)
    trainer.setup(momentum_schedule(0))
    trainer.train()
    trainer.model[2].eval()
    modes = [m.training for m in trainer.model.modules()]
    loader_state = trainer.loader.state_dict()
    trainer.evaluate()
    grad, training, _, draw = trainer.seen
    assert (grad, training) == (False, False)
    assert [m.training for m in trainer.model.modules()] == modes
    assert trainer.loader.state_dict() == loader_state
    trainer.evaluate()
    assert trainer.seen[3] == draw  # the RNG was put back after the first evaluate
    assert torch.is_grad_enabled()


def test_evaluate_can_keep_modes() -> None:
    class KeepModes(Recorder):
        evaluate_in_eval_mode = False

    trainer = KeepModes(CONFIG)
    trainer.evaluate()
    assert trainer.seen[1] is True and trainer.model.training


def test_no_trace_inside_train() -> None:
    class LogsInside(DigitsTrainer):
        def train(self) -> dict[str, float]:
            with self.no_trace():
                torch.rand(3)
                self.loader.next_batch()
            metrics = super().train()
            metrics["accuracy"] = self.evaluate()["accuracy"]  # evaluate nested in train
            return metrics

    ref, ref_train, _ = run(CONFIG, momentum_schedule, 4)
    trainer, train_metrics, _ = run(CONFIG, momentum_schedule, 4, cls=LogsInside, splits=(2,))
    assert [m["train_loss"] for m in train_metrics] == [m["train_loss"] for m in ref_train]
    assert_same_training(trainer, ref)


# -- discovery, setup and errors ---------------------------------------------------------------


class TwoOptimizers(TorchTrainer):
    """A hand-written trainer: modules/optimizers in containers, a scheduler, an alias."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.nets = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)])
        self.network = self.nets  # the same module under a later name: saved once
        self.optimizers = [
            torch.optim.SGD(self.nets[0].parameters(), lr=0.1, momentum=0.5),
            torch.optim.SGD(self.nets[1].parameters(), lr=0.1, momentum=0.5),
        ]
        self.schedulers = {
            "a": torch.optim.lr_scheduler.StepLR(self.optimizers[0], step_size=2, gamma=0.5)
        }
        self.data = StageLoader(torch.randn(50, 4), batch_size=5, seed=1)
        self.not_state = [1, 2, 3]

    def train(self) -> dict[str, float]:
        x = self.data.next_batch()
        loss = self.nets[1](torch.relu(self.nets[0](x))).pow(2).mean()
        for opt in self.optimizers:
            opt.zero_grad()
        loss.backward()
        for opt in self.optimizers:
            opt.step()
        self.schedulers["a"].step()
        return {"loss": loss.item()}

    def evaluate(self) -> dict[str, float]:
        return {"w": sum(p.sum().item() for p in self.nets.parameters())}


def test_discovery_order_containers_and_scheduler() -> None:
    trainer = TwoOptimizers({"seed": 2})
    assert list(trainer.checkpointed_objects()) == [
        "data",
        "nets",
        "optimizers.0",
        "optimizers.1",
        "schedulers.a",
    ]
    schedule: Schedule = lambda s: {"momentum": 0.5 if s < 3 else 0.0, "batch_size": 5 + s}  # noqa: E731
    ref, ref_train, _ = run({"seed": 2}, schedule, 7, cls=TwoOptimizers)
    got, got_train, _ = run({"seed": 2}, schedule, 7, cls=TwoOptimizers, splits=(1, 3, 4))
    assert got_train == ref_train
    assert_same(got.state_dict(), ref.state_dict())
    assert got.schedulers["a"].get_last_lr() == [0.1 * 0.5**3]  # type: ignore[attr-defined]
    assert got.data.batch_size == 11  # type: ignore[attr-defined]


def test_explicit_and_excluded_attributes() -> None:
    class Explicit(TwoOptimizers):
        checkpoint_attributes = ("nets", "optimizers")

    class Excluded(TwoOptimizers):
        checkpoint_exclude = ("schedulers", "data")

    assert list(Explicit({}).checkpointed_objects()) == ["nets", "optimizers.0", "optimizers.1"]
    assert list(Excluded({}).checkpointed_objects()) == ["nets", "optimizers.0", "optimizers.1"]

    class Missing(TwoOptimizers):
        checkpoint_attributes = ("nets", "nope")

    class Plain(TwoOptimizers):
        checkpoint_attributes = ("not_state",)

    with pytest.raises(CheckpointError, match="nope"):
        Missing({}).state_dict()
    with pytest.raises(CheckpointError, match="not_state"):
        Plain({}).state_dict()


def test_load_state_dict_is_strict() -> None:
    class Bigger(DigitsTrainer):
        def __init__(self, config: Mapping[str, Any]) -> None:
            super().__init__(config)
            self.head = torch.nn.Linear(2, 2)

    state = DigitsTrainer(CONFIG).state_dict()
    with pytest.raises(CheckpointError, match=r"missing \['head'\]"):
        Bigger(CONFIG).load_state_dict(state)
    with pytest.raises(CheckpointError, match=r"unexpected \['head'\]"):
        DigitsTrainer(CONFIG).load_state_dict(Bigger(CONFIG).state_dict())
    with pytest.raises(CheckpointError, match="format"):
        DigitsTrainer(CONFIG).load_state_dict({**state, "format": 99})


def test_setup_applies_known_values_and_keeps_the_rest() -> None:
    trainer = DigitsTrainer({**CONFIG, "optimizer": "adam"})
    trainer.setup({"lr": 0.5, "betas": (0.8, 0.9), "eps": 1e-6, "batch_size": 7.0, "mixup": 0.2})
    group = trainer.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"]) == (0.5, (0.8, 0.9), 1e-6)
    assert trainer.loader.batch_size == 7
    assert trainer.hp["mixup"] == 0.2
    trainer.setup({"beta2": 0.95})
    assert group["betas"] == (0.8, 0.95)
    assert trainer.hp == {
        "lr": 0.5,
        "betas": (0.8, 0.9),
        "eps": 1e-6,
        "batch_size": 7.0,
        "mixup": 0.2,
        "beta2": 0.95,
    }
    with pytest.raises(ValueError, match=r"Adam has no hyper-parameter 'momentum'"):
        trainer.setup({"momentum": 0.9})
    sgd = DigitsTrainer(CONFIG)
    with pytest.raises(ValueError, match=r"SGD has no hyper-parameter 'betas'"):
        sgd.setup({"betas": (0.9, 0.99)})
    with pytest.raises(ValueError, match="batch_size"):
        sgd.setup({"batch_size": 0})


def test_digits_trainer_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="unknown DigitsTrainer config keys"):
        DigitsTrainer({"hiden": 3})
    with pytest.raises(ValueError, match="optimizer"):
        DigitsTrainer({"optimizer": "lbfgs"})
    with pytest.raises(ValueError, match="seed"):
        DigitsTrainer({"seed": "abc"})


class DrawsInEvaluate(DigitsTrainer):
    """An evaluate that draws from every global generator (a random test subset, say)."""

    def evaluate(self) -> dict[str, float]:
        out = super().evaluate()
        out["noise"] = float(torch.rand(()).item() + np.random.rand() + random.random())
        return out


def test_an_evaluate_that_draws_leaves_every_stream_as_it_was() -> None:
    """The caller's generators after ``evaluate()`` are as before it, the trainer's own
    streams too (what it trains next), and the same evaluate draws the same numbers."""
    from stagetree.torch.rng import capture_global_rng

    config = {**CONFIG, "seed": 3}
    a, b = DrawsInEvaluate(config), DrawsInEvaluate(config)
    for t in (a, b):
        t.setup({"lr": 0.05, "momentum": 0.9})
        t.train()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    caller = capture_global_rng()
    first = a.evaluate()
    assert a.evaluate() == first  # drawn from the trainer's stream, put back each time
    after = capture_global_rng()
    assert torch.equal(after.cpu, caller.cpu) and after.python == caller.python
    assert np.array_equal(after.numpy["state"]["key"], caller.numpy["state"]["key"])
    assert after.numpy["state"]["pos"] == caller.numpy["state"]["pos"]
    assert a.train() == b.train()  # as if it had never evaluated


@pytest.fixture
def worker_process() -> Iterator[None]:
    """This process as a worker process sees it: nobody outside the trainers draws."""
    from stagetree.trainer import keep_caller_rng

    keep_caller_rng(False)
    try:
        yield
    finally:
        keep_caller_rng(True)


def test_a_worker_process_trains_and_evaluates_the_same(worker_process: None) -> None:
    """Where the caller's generators are nobody's, a trainer only swaps its own streams
    in: split runs, evaluations that draw, interleaved trainers all stay exact."""
    assert_noisy_splits_exact()
    a, b = DrawsInEvaluate(CONFIG), DrawsInEvaluate(CONFIG)
    for t in (a, b):
        t.setup({"lr": 0.05, "momentum": 0.9})
        t.train()
    first = a.evaluate()
    disturb_global_rng(5)
    assert a.evaluate() == first
    assert a.train() == b.train()  # as if it had never evaluated


def test_a_worker_process_swaps_the_generators_once_per_call(
    worker_process: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a worker process the caller's generators are neither captured nor put back:
    ``evaluate()`` restores the trainer's streams once and captures nothing;
    ``train()`` restores them once and captures what it drew."""
    import stagetree.torch.trainer as torch_trainer

    trainer = DigitsTrainer(CONFIG)
    trainer.setup(momentum_schedule(0))
    calls = {"capture": 0, "restore": 0}
    capture, restore = torch_trainer.capture_global_rng, torch_trainer.restore_global_rng

    def counting_capture() -> Any:
        calls["capture"] += 1
        return capture()

    def counting_restore(state: Any) -> None:
        calls["restore"] += 1
        restore(state)

    monkeypatch.setattr(torch_trainer, "capture_global_rng", counting_capture)
    monkeypatch.setattr(torch_trainer, "restore_global_rng", counting_restore)
    trainer.evaluate()
    assert calls == {"capture": 0, "restore": 1}
    trainer.train()
    assert calls == {"capture": 1, "restore": 2}


class CustomTrain(torch.nn.Module):
    """A module whose ``train()`` does more than set the flags."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(2, 2)
        self.switches = 0

    def train(self, mode: bool = True) -> CustomTrain:
        self.switches += 1
        return super().train(mode)


class WithCustomModule(DigitsTrainer):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.extra_module = CustomTrain()

    def evaluate(self) -> dict[str, float]:
        out = super().evaluate()
        out["extra_training"] = float(self.extra_module.training)
        out["model_training"] = float(self.model.training)
        return out


def test_evaluate_switches_modes_through_a_custom_train() -> None:
    """``evaluate()`` puts every module in eval mode; a module that overrides
    ``train()`` gets its own ``eval()`` called, plain ones only their flags set."""
    trainer = WithCustomModule(CONFIG)
    trainer.model.train()
    out = trainer.evaluate()
    assert out["extra_training"] == 0.0 and out["model_training"] == 0.0
    assert trainer.extra_module.switches >= 1
    assert trainer.model.training and trainer.extra_module.training
    assert all(m.training for m in trainer.model.modules())


def test_warmup_imports_what_the_first_trainer_build_would() -> None:
    """A worker warms its trainer class up while the workers start; the first trainer it
    builds then imports nothing more (before: the first optimizer imported
    ``torch._dynamo``, seconds that the first batch reported as its load time)."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from stagetree.torch.examples import DigitsConvTrainer\n"
        "DigitsConvTrainer.warmup()\n"
        "before = set(sys.modules)\n"
        "DigitsConvTrainer({'optimizer': 'momentum', 'channels': 4})\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
