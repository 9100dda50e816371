"""A TCP proxy on 127.0.0.1 that a test can cut: an outage of a database or an object
store without touching the server behind it.

While cut, the proxy closes every open connection and refuses new ones (it closes
them as soon as they are accepted), as a server that went away does.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class TCPProxy:
    """Forwards ``127.0.0.1:port`` to ``target`` (host, port) until :meth:`close`.

    Args:
        target: the address connections are forwarded to.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._up = threading.Event()
        self._up.set()
        self._closed = False
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True, name="tcp-proxy").start()

    def cut(self) -> None:
        """Take the service down: drop every connection, refuse new ones."""
        self._up.clear()
        with self._lock:
            conns, self._open = list(self._open), set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def restore(self) -> None:
        """Bring the service back."""
        self._up.set()

    def cut_for(self, seconds: float) -> threading.Thread:
        """Cut now and restore after ``seconds`` in a background thread (returned)."""
        self.cut()

        def later() -> None:
            time.sleep(seconds)
            self.restore()

        thread = threading.Thread(target=later, daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._up.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data or not self._up.is_set():
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            with self._lock:
                self._open.discard(src)
                self._open.discard(dst)
