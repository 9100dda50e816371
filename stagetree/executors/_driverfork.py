"""A fork server forked from the driver process itself, where that is safe: its workers
start without a fresh interpreter importing torch first (the driver has it already).

multiprocessing's fork server is a fresh interpreter: before it can fork the first
worker it imports torch (about a second on an idle machine, several on a busy one),
although the driver imported torch already. This server is a fork of the driver taken
when a run begins (:func:`~stagetree.executors.local.start_server_early`, from
``tune()`` before the storage opens; or when the executor gets ready or starts); it runs
multiprocessing's own fork-server loop (:func:`multiprocessing.forkserver.main`: the
same protocol, exit codes and sentinels, so its workers are ``forkserver`` processes in
every other respect). Before it forks a worker, it imports the modules the executor
preloads that the driver has not (what the trainer's warm-up imports,
``warmup_imports``), with the garbage collector off, and freezes them.

Forking a process is safe only when no other thread of it can hold a lock the child
needs, so the driver forks only when (otherwise the executor falls back to
multiprocessing's fork server):

- it runs on Linux, from its main thread, with no other Python thread alive;
- torch has not initialised CUDA (a forked child cannot use it);
- right after the fork, the driver has no native thread either. Thread pools that
  handle a fork (numpy's and scipy's OpenBLAS) stop their threads before it; others are
  still there (torch's OpenMP pool once the driver computed with several threads: a
  child's first parallel operation would wait forever for threads it does not have),
  and the child is told to end instead of serving. A thread whose library handles the
  fork itself does not count: jemalloc's background thread (pyarrow's allocator, which
  importing pandas or scikit-learn starts) takes jemalloc's locks before the fork and
  is turned off in the child;
- ``$STAGETREE_FORK_DRIVER`` is not ``0``.

What the child does not take over from the driver: it ignores Ctrl-C (the driver stops
the workers), resets the signal handlers the driver installed in Python, replaces the
driver's sockets and pipes other than its standard streams with ``/dev/null`` (a
database connection, a listening port or another process's pipe is not held open by the
server or the workers; the descriptor numbers stay taken, so a Python object of the
driver that closes its descriptor closes nothing of the child's), and never runs the
driver's exit hooks (it ends with :func:`os._exit`, as its workers do). It inherits the
driver's modules and their settings (torch's default dtype, for instance), as any
forked process does; each worker still sets its environment, threads and devices.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.popen_forkserver
import multiprocessing.util
import os
import signal
import socket
import stat
import sys
import threading
import traceback
import warnings
from multiprocessing import forkserver, resource_tracker, spawn
from typing import Any

from stagetree.executors._spec import no_main_rerun

# multiprocessing's fork server, its process and popen: private parts (untyped here).
_mp: Any = multiprocessing.context
_util: Any = multiprocessing.util
_ForkServer: Any = forkserver.ForkServer
_ForkServerPopen: Any = multiprocessing.popen_forkserver.Popen
_connection: Any = multiprocessing.connection

__all__ = [
    "driver_context",
    "fork_is_safe",
    "refusal",
    "server_pid",
    "start_helper",
    "stop_server",
]

ENV = "STAGETREE_FORK_DRIVER"


#: Native threads whose library makes forking safe while they run: jemalloc's background
#: thread (pyarrow's allocator, which importing pandas or scikit-learn starts): jemalloc
#: takes its own locks before a fork (``pthread_atfork``) and turns its background
#: threads off in the child, which runs without them.
FORK_SAFE_THREADS = frozenset({"jemalloc_bg_thd"})


def _threads() -> list[str]:
    """The names of the threads of this process that a fork may not leave behind: every
    thread, native ones included, but the main one and those of
    :data:`FORK_SAFE_THREADS`."""
    names = []
    main = str(os.getpid())
    for tid in os.listdir("/proc/self/task"):
        if tid == main:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # it ended meanwhile
        if name not in FORK_SAFE_THREADS:
            names.append(name)
    return sorted(names)


def _refusal() -> str | None:
    """Why this process may not fork its own fork server now (None: it may; see the
    module docstring; the native threads are checked again right after the fork)."""
    if os.environ.get(ENV, "1").strip() == "0":
        return f"${ENV} is 0"
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return "not on Linux"
    if threading.current_thread() is not threading.main_thread():
        return "not called from the main thread"
    if threading.active_count() != 1:
        others = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
        return f"other Python threads alive: {', '.join(others)}"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    with contextlib.suppress(Exception):
        if cuda is not None and cuda.is_initialized():
            return "CUDA is initialised"
    return None


def fork_is_safe() -> bool:
    """Whether this process may fork its own fork server now (see the module docstring;
    the native threads are checked again right after the fork)."""
    return _refusal() is None


class _DriverServer(_ForkServer):
    """multiprocessing's fork server, started by forking this process (one per process)."""

    _forkserver_address: Any
    _forkserver_alive_fd: int | None
    _forkserver_pid: int | None
    _lock: threading.Lock
    #: Why the last :meth:`start` did not fork (None: it forked, or none was asked).
    refused: str | None = None

    def forget(self) -> None:
        """In a forked child: the server is its parent's."""
        _ForkServer.__init__(self)
        self.refused = None

    def running(self) -> bool:
        """Whether the server forked earlier is alive (a dead one is reaped)."""
        if self._forkserver_pid is None:
            return False
        try:
            pid, _ = os.waitpid(self._forkserver_pid, os.WNOHANG)
        except ChildProcessError:  # reaped by someone else (SIGCHLD ignored): it ended
            pid = self._forkserver_pid
        if not pid:
            return True
        assert self._forkserver_alive_fd is not None
        os.close(self._forkserver_alive_fd)
        self._forkserver_address = self._forkserver_alive_fd = self._forkserver_pid = None
        return False

    def ensure_running(self) -> None:
        """(Called for each worker): a server that ended is not forked again here."""
        with self._lock:
            if not self.running():
                raise OSError("the fork server forked from the driver has ended")

    def stop(self) -> None:
        """End the server now, without waiting for the imports it may be doing (for
        seconds): it is killed and reaped. Only for a server no worker was forked from:
        a worker's end of its pipes would be cut."""
        with self._lock:
            pid = self._forkserver_pid
            if pid is None:
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            assert self._forkserver_alive_fd is not None
            os.close(self._forkserver_alive_fd)
            if not _util.is_abstract_socket_namespace(self._forkserver_address):
                with contextlib.suppress(OSError):
                    os.unlink(self._forkserver_address)
            self._forkserver_address = self._forkserver_alive_fd = self._forkserver_pid = None

    def start(self, preload: list[str]) -> bool:
        """Fork the server unless it runs already; False when this process may not fork
        now (nothing is left started then)."""
        with self._lock:
            if self.running():
                return True
            self.refused = _refusal()
            if self.refused is not None:
                return False
            resource_tracker.ensure_running()
            with socket.socket(socket.AF_UNIX) as listener:
                address = _connection.arbitrary_address("AF_UNIX")
                listener.bind(address)
                if not _util.is_abstract_socket_namespace(address):
                    os.chmod(address, 0o600)
                listener.listen()
                alive_r, alive_w = os.pipe()
                go_r, go_w = os.pipe()
                _util._flush_std_streams()  # nothing buffered is written twice
                # Python 3.12+ warns when a process with native threads forks; those
                # threads are counted right below and such a child only ends.
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    pid = os.fork()
                if pid == 0:
                    os.close(alive_w)
                    os.close(go_w)
                    _serve(listener.fileno(), alive_r, go_r, preload)  # never returns
                os.close(alive_r)
                os.close(go_r)
                # Thread pools that survive a fork are not fork-safe: the child ends.
                left = _threads()
                safe = not left
                if left:
                    self.refused = f"native threads left after a fork: {', '.join(left)}"
                with contextlib.suppress(OSError):
                    os.write(go_w, b"1" if safe else b"0")
                os.close(go_w)
                if not safe:
                    os.close(alive_w)
                    os.waitpid(pid, 0)
                    if not _util.is_abstract_socket_namespace(address):
                        with contextlib.suppress(OSError):
                            os.unlink(address)
                    return False
            self._forkserver_address = address
            self._forkserver_alive_fd = alive_w
            self._forkserver_pid = pid
            return True


def _serve(listener: int, alive_r: int, go_r: int, preload: list[str]) -> None:
    """The forked child: once the driver says it may, serve forks until the driver and
    every worker have ended (their ends of ``alive_r`` closed). Never returns."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        go = os.read(go_r, 1) == b"1"
        os.close(go_r)
        if go:
            _leave_driver(keep={0, 1, 2, listener, alive_r})
            _preload(preload)
            forkserver.main(listener, alive_r, [])
    except SystemExit:
        pass  # its loop's end: the driver and its workers are gone
    except BaseException:
        code = 1
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        _util._flush_std_streams()
        os._exit(code)


def _preload(modules: list[str]) -> None:
    """Import ``modules`` (one that fails fails again in a worker, which reports it)
    without collecting: the imports make objects that live as long as the server, which the
    collections would traverse again and again (about a seventh of the CPU time of
    importing ``torch._dynamo`` and scikit-learn); then freeze them for the workers."""
    gc.disable()
    try:
        for name in modules:
            with contextlib.suppress(Exception):
                importlib.import_module(name)
    finally:
        gc.freeze()
        gc.enable()


def _leave_driver(keep: set[int]) -> None:
    """Drop what the child must not hold of the driver: its fork server, Python signal
    handlers, and sockets and pipes (replaced with ``/dev/null``, their numbers kept
    taken)."""
    # The driver's own fork server (if it started one) is not the child's: a worker
    # that asks for one starts its own, as one forked from a fresh server would.
    _ForkServer.__init__(forkserver._forkserver)
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        if sig == signal.SIGINT:
            continue
        with contextlib.suppress(ValueError, OSError, TypeError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd in keep or fd == null:
                continue
            try:
                mode = os.fstat(fd).st_mode
            except OSError:
                continue  # the listing's own descriptor, closed by now
            if stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode):
                os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)


_SERVER = _DriverServer()


class _Popen(_ForkServerPopen):
    """A worker forked by :data:`_SERVER` (multiprocessing's ``_launch``, with that
    server instead of the process-wide one)."""

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        _mp.set_spawning_popen(self)
        try:
            _mp.reduction.dump(prep_data, buf)
            _mp.reduction.dump(process_obj, buf)
        finally:
            _mp.set_spawning_popen(None)
        self.sentinel, w = _SERVER.connect_to_new_process(self._fds)
        parent_w = os.dup(w)  # the child's sentinel of this process
        self.finalizer = _util.Finalize(self, _util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _Process(_mp.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _Popen(process_obj)


class _Context(_mp.ForkServerContext):
    Process = _Process


_CONTEXT = _Context()


def driver_context(preload: list[str]) -> Any:
    """The multiprocessing context of workers forked by the server forked from this
    process (forked now, with ``preload`` imported, unless it runs already), or None
    where this process may not fork it (see :func:`fork_is_safe`)."""
    return _CONTEXT if _SERVER.start(preload) else None


def start_helper(target: Any, args: tuple[Any, ...], name: str) -> Any:
    """``target(*args)`` started in a daemonic process forked by a fork server that runs
    already (the one forked from this process, else multiprocessing's, where this
    process started it: no fresh interpreter, nothing it preloaded imported again), its
    ``multiprocessing`` process object; None when neither runs or it cannot fork now.
    The caller joins it; a daemonic process left running is terminated at the program's
    exit."""
    ctx: Any = None
    with _SERVER._lock:
        if _SERVER.running():
            ctx = _CONTEXT
    if ctx is None and forkserver._forkserver._forkserver_pid is not None:  # type: ignore[attr-defined]
        ctx = multiprocessing.get_context("forkserver")
    if ctx is None:
        return None
    process = ctx.Process(target=target, args=args, name=name, daemon=True)
    try:
        with no_main_rerun():
            process.start()
    except OSError:  # the server ended meanwhile
        return None
    return process


def stop_server() -> None:
    """Kill and reap the fork server forked from this process, if one runs (see
    :meth:`_DriverServer.stop`: only one that no worker was forked from)."""
    _SERVER.stop()


def refusal() -> str | None:
    """Why this process did not fork its fork server when last asked to (the fork
    server of its workers is then a fresh interpreter), None when it did or was never
    asked: e.g. ``"native threads left after a fork: ..."`` with their names."""
    with _SERVER._lock:
        return _SERVER.refused


def server_pid() -> int | None:
    """The process id of the fork server forked from this process (None: none runs)."""
    with _SERVER._lock:
        return _SERVER._forkserver_pid if _SERVER.running() else None


# A child forked from this process (its server, a worker) has no server of its own.
os.register_at_fork(after_in_child=_SERVER.forget)
