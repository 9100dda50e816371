"""What :class:`~stagetree.executors.local.LocalExecutor` watches for its workers' events:
one ``poll`` object over its wake pipe and every worker's event pipe and process
sentinel, kept while the workers' pipes and processes stay the same.

``Connection.poll`` and ``Process.exitcode`` (a fork-server process's) each build a
selector, register one descriptor and poll it: looking at every worker that way costs
a selector per pipe and per process at every round of the driver, and a selector per
event read. With the poll object kept, a look at all the workers is one system call,
and only the workers it names are read (in worker order, as before).
"""

from __future__ import annotations

import math
import select
from collections.abc import Sequence
from typing import Any

from stagetree.executors._pool import Slot

__all__ = ["Watch"]

_READ = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR


class Watch:
    """Readiness of the wake pipe ``alarm`` and of ``slots``' event pipes and process
    sentinels (see the module docstring).

    Attributes:
        builds: poll objects built so far (for tests: one per change of the workers'
            pipes or processes, not one per look).
    """

    def __init__(self, alarm: int) -> None:
        self.alarm = alarm
        self.builds = 0
        self._key: tuple[Any, ...] | None = None
        self._poll: Any = None
        # descriptor -> index of its slot, and a poll object of each event pipe alone
        self._slot_of: dict[int, int] = {}
        self._alone: dict[int, Any] = {}

    def _refresh(self, slots: Sequence[Slot]) -> None:
        """Build the poll object again where a slot's pipe or process changed."""
        key = tuple(x for s in slots for x in (s.outbox, s.process))
        if key == self._key:
            return
        self.builds += 1
        poll = select.poll()
        poll.register(self.alarm, _READ)
        slot_of: dict[int, int] = {}
        alone: dict[int, Any] = {}
        for i, slot in enumerate(slots):
            if slot.outbox is None:
                continue
            fd = slot.outbox.fileno()
            poll.register(fd, _READ)
            slot_of[fd] = i
            alone[fd] = select.poll()
            alone[fd].register(fd, _READ)
            if slot.process is not None:
                sentinel = slot.process.sentinel
                poll.register(sentinel, _READ)
                slot_of[sentinel] = i
        self._key, self._poll, self._slot_of, self._alone = key, poll, slot_of, alone

    def look(self, slots: Sequence[Slot]) -> tuple[list[int], set[int]]:
        """The slots with an event to read or a process that ended, by index in worker
        order, and the descriptors ready now (without waiting)."""
        self._refresh(slots)
        ready = {fd for fd, _ in self._poll.poll(0)}
        slot_of = self._slot_of
        return sorted({slot_of[fd] for fd in ready if fd in slot_of}), ready

    def wait(self, timeout: float | None) -> bool:
        """Wait at most ``timeout`` s (None: no limit) for any descriptor of the last
        :meth:`look`; whether the wake pipe is among those ready."""
        ms = None if timeout is None else math.ceil(timeout * 1e3)
        return any(fd == self.alarm for fd, _ in self._poll.poll(ms))

    def readable(self, fd: int) -> bool:
        """Whether event pipe ``fd`` (one of the last :meth:`look`'s) has more to read
        (or reached its end: the read then says so)."""
        return bool(self._alone[fd].poll(0))
