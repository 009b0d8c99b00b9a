"""The listening socket of ``hetero-jax serve``: bound before the model loads, so a bad ``--host`` or a busy
``--port`` is refused in a second with the project's message, and handed to uvicorn, which listens on it."""

from __future__ import annotations

import errno
import socket

from hetero_jax.errors import ConfigError


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (``host``, ``port``), not yet listening (a client that connects before the server is
    ready is refused rather than left waiting); ConfigError naming the flag and the fix when it cannot be bound.
    Bound as uvicorn binds its own: IPv6 when the host has a colon, SO_REUSEADDR (a restart does not wait for the
    previous run's closed connections)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except socket.gaierror as e:
        sock.close()
        raise ConfigError(f"--host {host!r} is not an address or a host name that resolves ({e.strerror}); give an "
                          "address of this machine, e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every "
                          "interface)") from None
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"--port {port} is already in use on {host} (another server listens there); stop it "
                              "or give another --port (0: any free port)") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"--host {host} is not an address of this machine ({e.strerror}); give one of its "
                              "addresses, e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise ConfigError(f"--port {port} on {host} needs privileges this process lacks ({e.strerror}); give a "
                              "port >= 1024") from None
        raise ConfigError(f"cannot listen on --host {host} --port {port}: {e.strerror or e}; give another "
                          "--host or --port") from None
    return sock


def url(sock: socket.socket) -> str:
    """``http://HOST:PORT`` of a bound socket (its real port when --port was 0)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


def serve(app, sock: socket.socket, *, log_level: str, banner: str) -> None:
    """Run ``app`` with uvicorn on ``sock`` (from ``bind_socket``) until interrupted; print ``banner`` once the
    server listens (never when its start-up fails)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                print(banner, flush=True)

    server = Server(uvicorn.Config(app, log_level=log_level))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # a second Ctrl-C, re-raised by uvicorn after its shutdown (as uvicorn.run)
        pass
    finally:
        sock.close()
