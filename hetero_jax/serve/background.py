"""A server on 127.0.0.1 in a background thread of this process: for notebooks, benchmarks and tests that talk to
the app over HTTP while keeping the model in their own process."""

from __future__ import annotations

import socket
import threading
import time


class BackgroundServer:
    """``create_app(model, config)`` served by uvicorn on 127.0.0.1 and a free port, in a daemon thread.

    ``base``: the URL (``http://127.0.0.1:PORT``); ``app``: the Starlette app; ``close()`` stops it (also on
    ``with`` exit). Raises RuntimeError when uvicorn does not start within ``start_timeout_s``."""

    def __init__(self, model, config, start_timeout_s: float = 30.0):
        import uvicorn

        from hetero_jax.serve.app import create_app

        self.app = create_app(model, config)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.uv = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.uv.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the server on {self.base} did not start within {start_timeout_s:g} s")
            time.sleep(0.02)

    def close(self) -> None:
        self.uv.should_exit = True
        self.thread.join(60)

    def __enter__(self) -> "BackgroundServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
