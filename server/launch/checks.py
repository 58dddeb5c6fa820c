"""What the command line settles before it loads anything: its exit statuses, and whether the port is free."""
from __future__ import annotations

import socket

EXIT_LOAD_FAILED = 3
EXIT_WORKER_FAILED = 4
EXIT_PORT_IN_USE = 5


def bind_error(host: str, port: int) -> OSError | None:
    """Why the server could not listen on (host, port) now (bound as uvicorn binds it), or None: checked before
    the model loads, so that a taken port ends the start at once rather than after the load."""
    if port == 0:  # any free port
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as e:
        return e
    return None
