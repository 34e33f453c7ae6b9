"""A TCP proxy on 127.0.0.1 that holds every chunk the server sends for `delay_s`: a slow but live Redis (one
that answers within the client's socket timeout, so its breaker never opens)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from kvtier.rollout.server import free_port


class DelayProxy:
    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target_port, self.delay_s = target_port, delay_s
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, self.delay_s), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        try:
            while data := src.recv(1 << 16):
                time.sleep(delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                s.close()
