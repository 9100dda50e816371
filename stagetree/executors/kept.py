"""The checkpoints a worker wrote or read, kept in its memory for the batches it starts
from them.

A worker captures every checkpoint as an independent copy of its trainer's state (see
:func:`stagetree.executors.worker.snapshot_state`) and writes that copy to the store.
Batches often start from a checkpoint the same worker wrote moments before (the
siblings of a branch point it trained): keeping the copy saves reading the file back,
verifying its checksum and decoding it. The copy is the state the file holds, so a
trainer restored from either is the same. Likewise a checkpoint another worker wrote
is kept (a copy of what its verified file held) once read, for the next sibling
batch this worker starts from it.

Only states held in host memory are kept (tensors on the CPU, numpy arrays, plain
values): a state on an accelerator would hold device memory the trainer needs. The
bytes kept are bounded; the least recently used go first.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

__all__ = ["DEFAULT_KEEP_BYTES", "KeptStates", "host_nbytes"]

#: Default bound of the states one worker keeps (bytes of their tensors and arrays).
DEFAULT_KEEP_BYTES = 128 * 2**20


def host_nbytes(state: Any) -> int | None:
    """The bytes of the tensors and arrays of ``state``, None when one of its tensors is
    not in host memory (or its structure is not one a checkpoint holds)."""
    torch = sys.modules.get("torch")
    numpy = sys.modules.get("numpy")
    tensor = torch.Tensor if torch is not None else None
    array = numpy.ndarray if numpy is not None else None
    total = 0
    stack = [state]
    while stack:
        obj = stack.pop()
        if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
            continue
        if tensor is not None and isinstance(obj, tensor):
            if obj.device.type != "cpu":
                return None
            total += obj.element_size() * obj.nelement()
        elif array is not None and isinstance(obj, array):
            total += int(obj.nbytes)
        elif isinstance(obj, Mapping):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif numpy is not None and isinstance(obj, numpy.generic):
            continue
        else:
            return None
    return total


class KeptStates:
    """States by checkpoint ref, bounded by ``max_bytes`` (0: none is kept).

    Thread-safe: a worker's checkpoint writer thread adds, its batches read.
    """

    def __init__(self, max_bytes: int = DEFAULT_KEEP_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._states: OrderedDict[str, tuple[tuple[int, int], Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._states)

    @property
    def nbytes(self) -> int:
        """Bytes of the states kept now."""
        return self._bytes

    def put(self, ref: str, at: tuple[int, int], state: Any) -> bool:
        """Keep ``state``, the content of checkpoint ``ref`` of model position ``at``
        (``(node, step)``); the caller must not change it afterwards. Returns whether
        it was kept (not when it is not in host memory or larger than the bound)."""
        size = host_nbytes(state)
        if size is None or size > self.max_bytes:
            return False
        with self._lock:
            old = self._states.pop(ref, None)
            if old is not None:
                self._bytes -= old[2]
            self._states[ref] = (at, state, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, _, dropped) = self._states.popitem(last=False)
                self._bytes -= dropped
        return True

    def would_keep(self, state: Any) -> bool:
        """Whether :meth:`put` would keep ``state`` (in host memory, within the bound):
        asked before copying a state only to keep it."""
        size = host_nbytes(state)
        return self.max_bytes > 0 and size is not None and size <= self.max_bytes

    def get(self, ref: str, at: tuple[int, int] | None) -> Any:
        """The state kept for ``ref`` if it is the checkpoint of position ``at``, else
        None. The state is shared: copy it before a trainer may change it."""
        with self._lock:
            entry = self._states.get(ref)
            if entry is None or (at is not None and entry[0] != tuple(at)):
                return None
            self._states.move_to_end(ref)
            return entry[1]

    def clear(self) -> None:
        """Forget every state."""
        with self._lock:
            self._states.clear()
            self._bytes = 0
