"""A TCP proxy on 127.0.0.1 in front of a worker, that can cut or freeze a KV transfer on purpose."""

from __future__ import annotations

import socket
import threading

MARKER = b"POST /v1/kv/blocks"


class TransferProxy:
    """Forwards every connection to ``127.0.0.1:target_port``. :meth:`cut_next` makes the next
    ``POST /v1/kv/blocks`` stop after ``nbytes`` bytes (counted from its request line) with both
    sides closed; :meth:`freeze_next` makes it stop there with both sides left open (a worker that
    hangs). Each applies once."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.mode, self.limit, self.cuts = None, 0, 0
        self._lock = threading.Lock()
        self._held: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_next(self, nbytes: int) -> None:
        self.mode, self.limit = "cut", nbytes

    def freeze_next(self) -> None:
        self.mode, self.limit = "freeze", 0

    def close(self) -> None:
        self._closed = True
        self.sock.close()
        for s in self._held:
            s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()
            threading.Thread(target=self._forward, args=(client, upstream), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def _forward(self, client: socket.socket, upstream: socket.socket) -> None:
        tail, allowed, mode = b"", None, None
        try:
            while data := client.recv(65536):
                if allowed is None and self.mode is not None:
                    found = (tail + data).find(MARKER)
                    at = found - len(tail)  # where the request line starts in data (< 0: in the tail, sent)
                    if found >= 0:
                        with self._lock:
                            mode, self.mode = self.mode, None
                        if mode is not None:
                            upstream.sendall(data[:max(at, 0)])
                            allowed, data = self.limit - max(-at, 0), data[max(at, 0):]
                if allowed is not None:
                    if mode == "freeze":
                        self._held += [client, upstream]
                        return
                    if len(data) > allowed:
                        upstream.sendall(data[:allowed])
                        self.cuts += 1
                        upstream.shutdown(socket.SHUT_RDWR)
                        client.shutdown(socket.SHUT_RDWR)
                        return
                    allowed -= len(data)
                upstream.sendall(data)
                tail = (tail + data)[-len(MARKER):]
        except OSError:
            pass
