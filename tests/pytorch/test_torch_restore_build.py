"""A TorchTrainer built to be restored skips its parameters' random initialisation
(issue 22, efficiency: two thirds of building the digits MLP before every checkpoint
load), only when its class says so, and the restored trainer trains bit for bit as one
built in full."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

from stagetree.checkpoints import CheckpointStore  # noqa: E402
from stagetree.executors.worker import Worker  # noqa: E402
from stagetree.hp import Constant, MultiStep  # noqa: E402
from stagetree.torch.examples import DigitsConvTrainer, DigitsTrainer  # noqa: E402
from stagetree.torch.rng import seed_rng  # noqa: E402
from stagetree.trainer import building_to_restore, built_to_restore  # noqa: E402
from stagetree.work import CheckpointSaved, MetricsReported, RunBatch, Segment  # noqa: E402

pytestmark = pytest.mark.torch

CONFIG = {"hidden": 24, "dropout": 0.3, "optimizer": "momentum", "batches_per_step": 3}
CONV = {"channels": 4, "dropout": 0.2, "optimizer": "adam", "batches_per_step": 3}


def seeded_cpu_state(seed: int) -> Any:
    return torch.Generator().manual_seed(seed).get_state()


def trained(trainer: Any, steps: int, lr: float) -> list[Any]:
    trainer.setup({"lr": lr, "batch_size": 32})
    return [trainer.train() for _ in range(steps)]


def assert_same_state(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, Mapping):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_same_state(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}/{i}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    else:
        assert a == b, path


@pytest.mark.parametrize(("cls", "config"), [(DigitsTrainer, CONFIG), (DigitsConvTrainer, CONV)])
def test_a_restored_build_draws_nothing_and_trains_as_a_full_one(
    cls: type, config: dict[str, Any]
) -> None:
    torch.set_num_threads(1)
    source = cls(config)
    trained(source, 2, 0.1)
    state = source.state_dict()

    full = cls(config)
    # A full build draws the initial weights from the trainer's stream.
    assert not torch.equal(full.state_dict()["rng"]["torch"], seeded_cpu_state(0))
    with built_to_restore():
        assert building_to_restore()
        quick = cls(config)
    assert not building_to_restore()
    # Built to be restored: nothing drawn (the weights are the restore's).
    assert torch.equal(quick.state_dict()["rng"]["torch"], seeded_cpu_state(0))
    full.load_state_dict(state)
    quick.load_state_dict(state)
    assert_same_state(quick.state_dict(), full.state_dict())
    assert trained(quick, 3, 0.05) == trained(full, 3, 0.05)
    assert quick.evaluate() == full.evaluate()
    assert_same_state(quick.state_dict(), full.state_dict())


def test_seeding_without_accelerators_queues_no_accelerator_seed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What torch.manual_seed costs a trainer's build on a CPU-only machine: a seed
    queued (with its caller's stack) for each accelerator kind's initialisation."""
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is available: torch.manual_seed seeds it")
    queued: list[int] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", queued.append)
    seed_rng(7)
    assert queued == []
    assert torch.equal(torch.get_rng_state(), seeded_cpu_state(7))


class DrawsAfterItsModel(DigitsTrainer):
    """Draws a non-checkpointed value after building its model: it must not skip."""

    restore_skips_init = False

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.noise_scale = float(torch.rand(()).item())


def test_a_class_that_does_not_say_so_builds_in_full() -> None:
    plain = DrawsAfterItsModel(CONFIG)
    with built_to_restore():
        restored = DrawsAfterItsModel(CONFIG)
    assert restored.noise_scale == plain.noise_scale
    assert torch.equal(restored.state_dict()["rng"]["torch"], plain.state_dict()["rng"]["torch"])


class Spy(DigitsTrainer):
    """Records, per construction, whether it was built to be restored."""

    built: list[bool] = []

    def __init__(self, config: Mapping[str, Any]) -> None:
        Spy.built.append(building_to_restore())
        super().__init__(config)


def _batch(bid: int, node: int, start: int, stop: int, **kw: Any) -> RunBatch:
    hp = {"lr": MultiStep(0.1, [2], 0.5), "batch_size": Constant(32)}
    kw = {"start_at": None, "start_checkpoint": None, **kw}
    return RunBatch(
        batch_id=bid,
        worker=0,
        root_key="r",
        config=CONFIG,
        segments=(Segment(node, start, stop, hp),),
        start_step=start,
        **kw,
    )


def test_a_worker_builds_a_batchs_trainer_to_be_restored_exactly(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    events: list[Any] = []
    store = CheckpointStore(tmp_path)
    Spy.built.clear()
    alone = Worker(0, Spy, store, events.append)
    alone.run(_batch(1, 1, 0, 5, evaluate_at=((1, 5),)))
    alone.flush()
    first = Worker(0, Spy, store, events.append)
    first.run(_batch(2, 2, 0, 2, checkpoint_at=((2, 2),)))
    first.flush()
    ref = next(e.ref for e in events if isinstance(e, CheckpointSaved) and e.batch_id == 2)
    resumed = Worker(1, Spy, store, events.append, keep_bytes=0)
    resumed.run(_batch(3, 3, 2, 5, start_at=(2, 2), start_checkpoint=ref, evaluate_at=((3, 5),)))
    assert Spy.built == [False, False, True]
    metrics = [e.metrics for e in events if isinstance(e, MetricsReported)]
    assert metrics[0] == metrics[1]
    assert alone._trainer is not None and resumed._trainer is not None
    assert_same_state(resumed._trainer.state_dict(), alone._trainer.state_dict())
