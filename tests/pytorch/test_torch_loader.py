"""StageLoader: deterministic order, resumable anywhere, batch size changeable mid-epoch."""

from __future__ import annotations

import io
from typing import Any

import pytest

pytest.importorskip("torch")

import numpy as np
import torch
from torch.utils.data import TensorDataset

from stagetree.torch import StageLoader

pytestmark = pytest.mark.torch

N = 23


def draw(loader: StageLoader, sizes: list[int]) -> list[list[int]]:
    batches = []
    for size in sizes:
        loader.set_batch_size(size)
        batches.append(loader.next_indices().tolist())
    return batches


def test_order_is_a_function_of_seed_and_epoch() -> None:
    a = StageLoader(torch.arange(N), batch_size=5, seed=3)
    b = StageLoader(torch.arange(N), batch_size=5, seed=3)
    first = [a.next_batch().tolist() for _ in range(15)]
    assert first == [b.next_batch().tolist() for _ in range(15)]
    # 23 = 4 * 5 + 3: five batches per epoch, the last one partial.
    epochs = [[s for batch in first[i : i + 5] for s in batch] for i in (0, 5, 10)]
    assert [len(batch) for batch in first[:5]] == [5, 5, 5, 5, 3]
    for epoch, samples in enumerate(epochs):
        assert sorted(samples) == list(range(N))
        assert samples == a.order(epoch).tolist()
    assert epochs[0] != epochs[1] != epochs[2]
    other = StageLoader(torch.arange(N), batch_size=5, seed=4)
    assert other.order(0).tolist() != a.order(0).tolist()


def test_global_rng_is_neither_used_nor_read() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    loader = StageLoader(torch.arange(N), batch_size=4, seed=1)
    first = [loader.next_indices().tolist() for _ in range(12)]
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(99)
    again = StageLoader(torch.arange(N), batch_size=4, seed=1)
    assert [again.next_indices().tolist() for _ in range(12)] == first


@pytest.mark.parametrize("stop", [0, 1, 3, 5, 6, 7, 11])
def test_resume_anywhere_equals_uninterrupted(stop: int) -> None:
    sizes = [4, 4, 7, 2, 9, 9, 1, 4, 4, 23, 5, 6, 6]
    whole = draw(StageLoader(torch.arange(N), batch_size=4, seed=8), sizes)
    first = StageLoader(torch.arange(N), batch_size=4, seed=8)
    head = draw(first, sizes[:stop])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    resumed = StageLoader(torch.arange(N), batch_size=99, seed=8)
    resumed.load_state_dict(state)
    assert resumed.batch_size == first.batch_size
    assert head + draw(resumed, sizes[stop:]) == whole


def test_batch_size_change_continues_at_the_position() -> None:
    loader = StageLoader(torch.arange(N), batch_size=4, seed=2)
    order = loader.order(0).tolist()
    assert draw(loader, [4, 4, 6, 3]) == [order[0:4], order[4:8], order[8:14], order[14:17]]
    assert (loader.epoch, loader.position) == (0, 17)
    assert loader.state_dict() == {"epoch": 0, "position": 17, "batch_size": 3}
    # 6 left and a batch of 10: the partial remainder, then epoch 1 from its start.
    assert draw(loader, [10, 10]) == [order[17:], loader.order(1).tolist()[:10]]
    assert (loader.epoch, loader.position) == (1, 10)


def test_drop_last_skips_a_remainder_that_does_not_fit_at_draw_time() -> None:
    loader = StageLoader(torch.arange(N), batch_size=5, seed=2, drop_last=True)
    order0, order1 = loader.order(0).tolist(), loader.order(1).tolist()
    batches = draw(loader, [5, 5, 5, 5])
    assert batches == [order0[i : i + 5] for i in (0, 5, 10, 15)]
    # 3 samples left: with batch size 3 they still fit ...
    assert draw(loader, [3]) == [order0[20:]]
    loader2 = StageLoader(torch.arange(N), batch_size=5, seed=2, drop_last=True)
    draw(loader2, [5, 5, 5, 5])
    # ... with 5 they are skipped and the batch comes from epoch 1.
    assert draw(loader2, [5]) == [order1[:5]]
    assert len(loader2) == 4
    assert len(StageLoader(torch.arange(N), batch_size=5, seed=2)) == 5


def test_iteration_walks_one_epoch() -> None:
    loader = StageLoader(torch.arange(N), batch_size=10, seed=0, shuffle=False)
    assert [b.tolist() for b in loader] == [list(range(10)), list(range(10, 20)), [20, 21, 22]]
    assert loader.epoch == 0
    loader.set_batch_size(20)
    assert [b.tolist() for b in loader] == [list(range(20)), [20, 21, 22]]
    assert loader.epoch == 1
    loader.next_batch()
    assert [b.tolist() for b in loader] == [[20, 21, 22]]  # the rest of epoch 2


def test_dataset_kinds_collate_to_the_same_batches() -> None:
    x = torch.arange(N * 2, dtype=torch.float32).reshape(N, 2)
    y = torch.arange(N) % 3
    samples = [(x[i], int(y[i])) for i in range(N)]
    loaders = [
        StageLoader(TensorDataset(x, y), batch_size=6, seed=5),
        StageLoader((x, y), batch_size=6, seed=5),
        StageLoader((x.numpy(), y.numpy()), batch_size=6, seed=5),
        StageLoader(samples, batch_size=6, seed=5),
    ]
    for _ in range(6):
        ref_x, ref_y = loaders[0].next_batch()
        for loader in loaders[1:]:
            got_x, got_y = loader.next_batch()
            assert torch.equal(got_x, ref_x) and torch.equal(got_y, ref_y)
    only_x = StageLoader(x, batch_size=6, seed=5)
    assert torch.equal(only_x.next_batch(), x[only_x.order(0)[:6]])


@pytest.mark.parametrize("value", [6.0, np.int64(6), torch.tensor(6).item()])
def test_integral_batch_sizes_are_accepted(value: Any) -> None:
    loader = StageLoader(torch.arange(N), batch_size=1, seed=0)
    loader.set_batch_size(value)
    assert loader.batch_size == 6 and isinstance(loader.batch_size, int)


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "4", None])
def test_bad_batch_sizes_are_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        StageLoader(torch.arange(N), batch_size=value, seed=0)


def test_bad_datasets_and_states_are_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StageLoader(torch.zeros(0, 3), batch_size=1, seed=0)
    with pytest.raises(ValueError, match="different lengths"):
        StageLoader((torch.zeros(4), torch.zeros(5)), batch_size=1, seed=0)
    with pytest.raises(ValueError, match="drop_last"):
        StageLoader(torch.arange(N), batch_size=N + 1, seed=0, drop_last=True)
    loader = StageLoader(torch.arange(N), batch_size=4, seed=0)
    with pytest.raises(ValueError, match="does not fit"):
        loader.load_state_dict({"epoch": 0, "position": N + 1})
    loader.load_state_dict({"epoch": 2, "position": N})  # the end of an epoch is valid
    assert loader.next_indices().tolist() == loader.order(3)[:4].tolist()


# -- prefetch ------------------------------------------------------------------------------


class _Items:
    """An indexable dataset that records the thread fetching each item."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.threads: set[str] = set()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        import threading

        self.threads.add(threading.current_thread().name)
        return torch.tensor([i, 2 * i])


@pytest.mark.parametrize("drop_last", [False, True])
def test_prefetch_gives_the_same_batches_and_positions(drop_last: bool) -> None:
    """Batches fetched ahead change neither the batches nor the checkpointed cursor,
    through batch size changes (which drop what was fetched for the old size) and loaded
    states."""
    sizes = [4, 4, 7, 2, 9, 9, 1, 4, 4, 5, 6, 6, 3, 3, 3, 8]
    runs = []
    for prefetch in (0, 1, 3):
        items = _Items(N)
        loader = StageLoader(items, batch_size=4, seed=2, drop_last=drop_last, prefetch=prefetch)
        seen = []
        saved: dict[str, int] = {}
        for step, size in enumerate(sizes):
            if step % 3 == 0:
                loader.set_batch_size(size)
            if step == 9:  # a checkpoint loaded mid-epoch: back to the state after step 4
                loader.load_state_dict(saved)
            seen.append((loader.next_batch().tolist(), loader.state_dict()))
            if step == 4:
                saved = dict(loader.state_dict())
        runs.append(seen)
        if prefetch:
            assert any(name.startswith("StageLoader-prefetch") for name in items.threads)
        loader.close()
    assert runs[0] == runs[1] == runs[2]


def test_prefetch_is_refused_unless_a_count() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prefetch must be an integer >= 0"):
            StageLoader(torch.arange(N), batch_size=4, seed=0, prefetch=bad)  # type: ignore[arg-type]


def test_a_prefetching_loader_copies_and_pickles() -> None:
    import copy
    import pickle

    loader = StageLoader(torch.arange(N), batch_size=4, seed=0, prefetch=2)
    loader.next_batch()
    copies = [copy.deepcopy(loader), pickle.loads(pickle.dumps(loader))]
    expected = loader.next_batch()
    for other in copies:
        assert torch.equal(other.next_batch(), expected)
        assert other.state_dict() == loader.state_dict()


def _train_digits(prefetch: int) -> list[Any]:
    """A digits trainer whose loader fetches ``prefetch`` batches ahead: 8 steps with a
    new batch size at step 5, and a copy resumed from a checkpoint taken mid-epoch at
    step 3. Returns what it saw: per run, the batches' labels and loader states, the
    final weights and loader state."""
    pytest.importorskip("sklearn")
    from stagetree.torch.examples import DigitsTrainer

    class Prefetching(DigitsTrainer):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            old = self.loader
            self.loader = StageLoader(
                old.dataset, batch_size=old.batch_size, seed=old.seed, prefetch=prefetch
            )
            self.seen: list[Any] = []

        def next_batch(self) -> Any:
            batch = super().next_batch()
            self.seen.append((batch[1].tolist(), self.loader.state_dict()))
            return batch

    def run(trainer: Prefetching, steps: range) -> Prefetching:
        for step in steps:
            if step == 5:
                trainer.setup({"batch_size": 48})
            trainer.train()
        return trainer

    config = {"batches_per_step": 3, "batch_size": 32, "seed": 4}
    whole = Prefetching(config)
    run(whole, range(3))
    checkpoint = whole.state_dict()
    run(whole, range(3, 8))
    resumed = Prefetching(config)
    resumed.load_state_dict(checkpoint)
    run(resumed, range(3, 8))
    out = []
    for trainer in (whole, resumed):
        state = trainer.state_dict()
        weights = [t.tolist() for t in trainer.model.state_dict().values()]
        out.append((trainer.seen[-15:], weights, state["objects"]["loader"]))
    assert 0 < checkpoint["objects"]["loader"]["position"] < len(whole.loader.dataset[0])
    return out


def test_a_trainer_with_prefetch_trains_and_resumes_as_without() -> None:
    without, with_prefetch = _train_digits(0), _train_digits(4)
    assert with_prefetch == without
    assert without[0] == without[1]  # the resumed run continues exactly
