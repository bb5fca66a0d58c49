"""A TCP load balancer for tests: each new connection goes to the first backend that accepts it.

What a client behind a load balancer sees when a gateway dies: its open connection breaks, and its next
connection reaches the next gateway. No HTTP parsing, no retries of its own.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class FirstLiveProxy:
    def __init__(self, backends: list[str]) -> None:
        """`backends`: "host:port" addresses, in order of preference."""
        self.backends = backends
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        for address in self.backends:
            host, port = address.rsplit(":", 1)
            try:
                backend = socket.create_connection((host, int(port)), timeout=2)
                break
            except OSError:
                continue
        else:
            client.close()
            return
        backend.settimeout(None)
        threading.Thread(target=_pipe, args=(backend, client), daemon=True).start()
        _pipe(client, backend)

    def close(self) -> None:
        self._closed = True
        self._server.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    """Copy src to dst until either side ends; then close both (the client sees the break)."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
