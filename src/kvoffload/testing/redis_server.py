"""A real ``redis-server`` process on a free loopback port, for the remote tier's tests and ``kvoffload bench remote``.

It starts the Debian package's (or any) ``redis-server`` binary found on ``PATH`` with persistence off, bound to
127.0.0.1 only, in a private temporary directory, and stops it (SIGKILL if it must) on ``stop()`` or at the end of
a ``with`` block. ``restart()`` brings a killed server back on the same port, empty. Extra server options (a
password, ``maxmemory``, a policy) are passed as ``redis-server`` command-line flags. ``RedisCluster`` joins three
such servers into a Redis Cluster (``redis-cli --cluster create``). No kvoffload code needs this module at serving
time.
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
CLUSTER_TIMEOUT_S = 30.0
"""For ``redis-cli --cluster create`` and the gossip after it: 2-3 s here, once over 10 s in a make check."""


class RedisServerUnavailable(RuntimeError):
    """No ``redis-server`` binary on PATH (``make setup`` installs the Debian package)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """``count`` different free ports (one ``free_port`` after another may repeat a port just closed)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


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


class RedisCluster:
    """A Redis Cluster of ``size`` primaries (no replicas), each a ``RedisServer`` on 127.0.0.1.

    Each node gets a free client port and a free cluster-bus port (``cluster-port``: the default, port + 10000,
    may be taken or above 65535). ``redis-cli --cluster create`` assigns the slots; the constructor returns once
    every node's ``CLUSTER INFO`` says ``cluster_state:ok``.

    Raises:
        RedisServerUnavailable: no ``redis-server`` or ``redis-cli`` on PATH.
        RuntimeError: the cluster did not form within ``CLUSTER_TIMEOUT_S``; the message holds redis-cli's output.
    """

    def __init__(self, size: int = 3, options: dict[str, str] | None = None) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RedisServerUnavailable("redis-cli is not installed (the Debian package redis-tools)")
        ports = free_ports(2 * size)
        self.nodes: list[RedisServer] = []
        try:
            for port, bus in zip(ports[:size], ports[size:], strict=True):
                node_options = {"cluster-enabled": "yes", "cluster-config-file": "nodes.conf",
                                "cluster-port": str(bus), **(options or {})}
                self.nodes.append(RedisServer(node_options, port=port))
            self._create(cli)
            self._wait_ok()
        except BaseException:
            self.stop()
            raise

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(node.url for node in self.nodes)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    def _create(self, cli: str) -> None:
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        done = subprocess.run([cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
                              capture_output=True, text=True, timeout=CLUSTER_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + CLUSTER_TIMEOUT_S
        waiting = list(self.nodes)
        while waiting and time.monotonic() < deadline:
            waiting = [node for node in waiting if b"cluster_state:ok" not in _cluster_info(node.port)]
            if waiting:
                time.sleep(0.05)  # polling the servers' gossip, not our own work
        if waiting:
            raise RuntimeError(f"the cluster on ports {[n.port for n in self.nodes]} is not ok after "
                               f"{CLUSTER_TIMEOUT_S:.0f} s: {_cluster_info(waiting[0].port)!r}")


def _cluster_info(port: int) -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"CLUSTER INFO\r\n")
            return conn.recv(4096)
    except OSError:
        return b""
