"""A resumable minibatch loader whose order depends only on (seed, epoch).

:class:`StageLoader` exists because a stage may end anywhere, even in the middle of an
epoch, and the next stage (possibly on another worker, possibly with another batch size)
must continue with exactly the samples an uninterrupted run would have drawn.

With ``prefetch=N`` a background thread collates the next ``N`` batches while the model
trains on the current one (the Hippo paper's §5.1), without changing what a batch holds,
their order, or the position :meth:`StageLoader.state_dict` saves (the batches handed
out, not those fetched ahead).
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset, default_collate

__all__ = ["StageLoader"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def epoch_seed(seed: int, epoch: int) -> int:
    """Seed of the permutation of ``epoch``: a 63-bit hash of ``(seed, epoch)``."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (epoch & _MASK64)) >> 1


def _as_batch_size(value: Any) -> int:
    # Sequence values may arrive as floats (64.0) or numpy integers.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"batch_size must be a positive integer, got {value!r}")
    as_float = float(value)
    if not as_float.is_integer() or as_float < 1:
        raise ValueError(f"batch_size must be a positive integer, got {value!r}")
    return int(as_float)


class StageLoader:
    """Minibatches in a deterministic order, resumable at any position.

    Epoch ``e`` visits the dataset in the order ``torch.randperm(n, generator=g)`` where
    ``g`` is a fresh generator seeded with a hash of ``(seed, e)`` (``0 .. n-1`` in order
    when ``shuffle`` is False). The global RNGs are never touched, so model code that draws
    random numbers (dropout, augmentation) does not change the data order and vice versa.

    The loader is a cursor ``(epoch, position)`` into that sequence of permutations.
    :meth:`next_batch` returns the next ``batch_size`` samples from ``position``; the
    batch size may change between any two calls (:meth:`set_batch_size`) and the next batch
    simply continues at the current position. A batch never mixes two epochs. When fewer
    than ``batch_size`` samples are left in the epoch:

    * ``drop_last=False``: the next batch is the smaller remainder; the call after it
      starts the next epoch;
    * ``drop_last=True``: the remainder is skipped and the batch is the first
      ``batch_size`` samples of the next epoch.

    Whether the remainder fits is decided when the next batch is drawn, with the batch size
    in force at that moment.

    :meth:`state_dict` is ``{"epoch", "position", "batch_size"}``; a loader built with the
    same dataset and seed and given that state continues exactly.

    Args:
        dataset: a tensor (batches are ``dataset[idx]``), a ``TensorDataset`` or a tuple of
            tensors / numpy arrays of equal length (batches are tuples of fancy-indexed
            tensors, the fast path), or anything indexable with ``__len__`` (items are
            collated with ``torch.utils.data.default_collate``).
        batch_size: samples per batch, >= 1.
        seed: seed of the data order.
        shuffle: permute every epoch; False keeps the dataset order.
        drop_last: skip an epoch's remainder smaller than ``batch_size`` (see above).
        prefetch: batches a background thread collates ahead (0: none). The batches, their
            order and the checkpointed position are the same as without; a batch fetched
            ahead for a cursor that has moved otherwise since (a new batch size, a loaded
            state) is dropped and fetched again. The thread reads ``dataset``: an
            indexable dataset whose items draw random numbers (augmentation in
            ``__getitem__``) would draw them from another thread, so keep such draws in
            the training code.

    Raises:
        ValueError: an empty dataset, columns of different lengths, a bad batch size, a
            negative ``prefetch``, or ``drop_last`` with a batch size larger than the
            dataset.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = False,
        prefetch: int = 0,
    ) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an integer >= 0, got {prefetch!r}")
        self.prefetch = prefetch
        # Batches fetched ahead: (cursor they start from, their indices' future batch).
        self._ahead: deque[tuple[tuple[int, int, int], Future[Any]]] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self._columns: tuple[torch.Tensor, ...] | None = None
        self._tensor: torch.Tensor | None = None
        if isinstance(dataset, torch.Tensor):
            self._tensor = dataset
            size = dataset.shape[0] if dataset.dim() > 0 else 0
        elif isinstance(dataset, TensorDataset):
            self._columns = tuple(dataset.tensors)
            size = len(dataset)
        elif (
            isinstance(dataset, tuple)
            and dataset
            and all(isinstance(c, (torch.Tensor, np.ndarray)) for c in dataset)
        ):
            self._columns = tuple(torch.as_tensor(c) for c in dataset)
            lengths = {c.shape[0] if c.dim() > 0 else 0 for c in self._columns}
            if len(lengths) != 1:
                raise ValueError(f"dataset columns have different lengths: {sorted(lengths)}")
            size = lengths.pop()
        else:
            size = len(dataset)
        if size < 1:
            raise ValueError("StageLoader needs a non-empty dataset")
        self.dataset = dataset
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self._size = int(size)
        self._batch_size = 1
        self.set_batch_size(batch_size)
        self._epoch = 0
        self._position = 0
        self._orders: dict[int, torch.Tensor] = {}  # the current epoch's and the next's

    # -- cursor ---------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Samples in the next batch (fewer at the end of an epoch without drop_last)."""
        return self._batch_size

    @property
    def epoch(self) -> int:
        """Epoch of the last batch drawn (0 before the first one)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Samples of the current epoch already drawn."""
        return self._position

    def __len__(self) -> int:
        """Batches in one whole epoch at the current batch size."""
        if self.drop_last:
            return self._size // self._batch_size
        return math.ceil(self._size / self._batch_size)

    def set_batch_size(self, batch_size: int) -> None:
        """Use ``batch_size`` from the next batch on; the position in the epoch is kept."""
        value = _as_batch_size(batch_size)
        if self.drop_last and value > self._size:
            raise ValueError(
                f"batch_size {value} exceeds the dataset size {self._size}: with "
                "drop_last=True no batch could ever be drawn"
            )
        self._batch_size = value

    def order(self, epoch: int) -> torch.Tensor:
        """Indices of the samples of ``epoch`` in the order they are drawn."""
        if not self.shuffle:
            return torch.arange(self._size)
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        return torch.randperm(self._size, generator=generator)

    def _order_of(self, epoch: int) -> torch.Tensor:
        order = self._orders.get(epoch)
        if order is None:
            self._orders = {e: o for e, o in self._orders.items() if e in (epoch - 1, epoch)}
            order = self._orders[epoch] = self.order(epoch)
        return order

    def _epoch_done(self) -> bool:
        return self._done(self._epoch, self._position)

    def _done(self, epoch: int, position: int) -> bool:
        left = self._size - position
        return left == 0 or (self.drop_last and left < self._batch_size)

    def _draw(self, epoch: int, position: int) -> tuple[torch.Tensor, int, int]:
        """The indices of the batch drawn at cursor ``(epoch, position)`` and the cursor
        after it (at the current batch size)."""
        if self._done(epoch, position):
            epoch, position = epoch + 1, 0
        indices = self._order_of(epoch)[position : position + self._batch_size]
        return indices, epoch, position + indices.shape[0]

    def _cursor(self) -> tuple[int, int, int]:
        return (self._epoch, self._position, self._batch_size)

    def next_indices(self) -> torch.Tensor:
        """Dataset indices of the next batch (int64 tensor); advances the cursor."""
        indices, self._epoch, self._position = self._draw(self._epoch, self._position)
        return indices

    def next_batch(self) -> Any:
        """The next batch, moving on to the next epoch when the current one is done."""
        if not self.prefetch:
            return self.fetch(self.next_indices())
        cursor = self._cursor()
        ahead = self._ahead
        while ahead and ahead[0][0] != cursor:  # fetched for a cursor that moved otherwise
            ahead.popleft()[1].cancel()
        future = ahead.popleft()[1] if ahead else None
        indices = self.next_indices()
        batch = self.fetch(indices) if future is None else future.result()
        self._fetch_ahead()
        return batch

    def _fetch_ahead(self) -> None:
        """Queue the fetches of the batches after the cursor, up to ``prefetch``."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="StageLoader-prefetch")
        epoch, position, size = self._ahead[-1][0] if self._ahead else self._cursor()
        if self._ahead:  # the cursor after the last batch queued
            _, epoch, position = self._draw(epoch, position)
        while len(self._ahead) < self.prefetch:
            indices, after_epoch, after_position = self._draw(epoch, position)
            future = self._pool.submit(self.fetch, indices)
            self._ahead.append(((epoch, position, size), future))
            epoch, position = after_epoch, after_position

    def close(self) -> None:
        """Drop the batches fetched ahead and stop the prefetch thread (it starts again
        with the next batch)."""
        for _, future in self._ahead:
            future.cancel()
        self._ahead.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def fetch(self, indices: torch.Tensor) -> Any:
        """Collate the samples at ``indices`` (does not move the cursor)."""
        if self._tensor is not None:
            return self._tensor[indices]
        if self._columns is not None:
            return tuple(column[indices] for column in self._columns)
        return default_collate([self.dataset[i] for i in indices.tolist()])

    def __iter__(self) -> Iterator[Any]:
        """Yield the rest of the current epoch (all of the next one if it is done).

        ``for batch in loader`` therefore walks one epoch, like a ``DataLoader``, while
        :meth:`next_batch` runs on forever.
        """
        if self._epoch_done():
            self._epoch += 1
            self._position = 0
        epoch = self._epoch
        while self._epoch == epoch and not self._epoch_done():
            yield self.next_batch()

    # -- checkpointing ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position", "batch_size"}``: where the next batch starts."""
        return {"epoch": self._epoch, "position": self._position, "batch_size": self._batch_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict` of a loader over the same dataset and seed."""
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self._size:
            raise ValueError(
                f"loader state epoch={epoch} position={position} does not fit a dataset "
                f"of {self._size} samples"
            )
        if "batch_size" in state:
            self.set_batch_size(state["batch_size"])
        self._epoch = epoch
        self._position = position
        # Batches fetched ahead for another cursor are dropped by the next next_batch().

    def __getstate__(self) -> dict[str, Any]:
        # A copy (pickled, deep-copied) fetches ahead on its own thread when it draws.
        return {**self.__dict__, "_ahead": deque(), "_pool": None}

    def __repr__(self) -> str:
        return (
            f"StageLoader(size={self._size}, batch_size={self._batch_size}, seed={self.seed}, "
            f"epoch={self._epoch}, position={self._position})"
        )
