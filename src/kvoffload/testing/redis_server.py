"""A real ``redis-server`` process on a free loopback port, for the remote tier's tests and ``kvoffload bench remote``.

It starts the Debian package's (or any) ``redis-server`` binary found on ``PATH`` with persistence off, bound to
127.0.0.1 only, in a private temporary directory, and stops it (SIGKILL if it must) on ``stop()`` or at the end of
a ``with`` block. ``restart()`` brings a killed server back on the same port, empty. Extra server options (a
password, ``maxmemory``, a policy) are passed as ``redis-server`` command-line flags. No kvoffload code needs
this module at serving time.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

START_TIMEOUT_S = 10.0


class RedisServerUnavailable(RuntimeError):
    """No ``redis-server`` binary on PATH (``make setup`` installs the Debian package)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` on 127.0.0.1.

    Args:
        options: extra ``--name value`` pairs, e.g. ``{"requirepass": "pw", "maxmemory": "1mb"}``.
        port: the port (default: a free one).
    Raises:
        RedisServerUnavailable: no ``redis-server`` on PATH.
        RuntimeError: it did not start answering within ``START_TIMEOUT_S``; the message holds its log.
    """

    def __init__(self, options: dict[str, str] | None = None, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisServerUnavailable("redis-server is not installed: run `make setup` (installs the Debian "
                                         "package redis-server as root) or apt-get install redis-server")
        self.binary = binary
        self.options = dict(options or {})
        self.port = port or free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="kvoffload-redis-"))
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.directory), "--protected-mode", "yes"]
        for name, value in self.options.items():
            args += [f"--{name}", value]
        log = (self.directory / "server.log").open("wb")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_ready()

    def kill(self) -> None:
        """SIGKILL, as a crash would; the port is free again afterwards."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def restart(self) -> None:
        """Kill it and start it again on the same port, empty (persistence is off)."""
        self.kill()
        self.start()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                break
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    reply = conn.recv(64)
                if reply.startswith((b"+PONG", b"-NOAUTH")):
                    return
            except OSError:
                pass
            time.sleep(0.02)  # polling a child process's start-up
        log = (self.directory / "server.log").read_text(errors="replace")[-2000:]
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not start:\n{log}")
