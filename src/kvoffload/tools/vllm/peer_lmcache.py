"""LMCache beside vLLM for ``kvoffload bench peer``: its server process, and what a vLLM engine needs to use it.

Data flow: ``kvoffload bench peer`` starts an ``LMCacheServer`` (LMCache's multiprocess server,
``python -m lmcache.v1.multiprocess.http_server``, from its own venv ``.venv-lmcache``, loopback only, usage
telemetry off) -> a demo engine child whose ``EngineSettings.lmcache`` is an ``LMCacheSide`` calls
``prepare_engine`` (LMCache importable, vLLM's kernel-override scan guarded) and runs vLLM with
``connector_config`` (vLLM's ``LMCacheMPConnector``, which talks to the server over ZMQ and moves the KV through
POSIX shared memory) -> the bench reads the server's ``/status`` (L1 bytes) and CPU time, then stops it and removes
the shared-memory segments the engines it started left behind.

The engine runs in our venv: its torch, numpy and transformers stay ours. ``build_overlay`` links only
``lmcache`` and the top-level modules of LMCache's venv that ours lacks into one directory appended to the
engine's ``sys.path`` (found after ours, so nothing of ours is shadowed). Nothing here imports lmcache itself.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERSION = "0.5.6"
"""The LMCache release ``requirements-lmcache.txt`` pins and these figures were taken with."""
DEFAULT_VENV = Path(".venv-lmcache")
SERVER_MODULE = "lmcache.v1.multiprocess.http_server"
SHM_DIR = Path("/dev/shm")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class LMCacheSide:
    """What an engine child needs to use a running LMCache server (picklable)."""

    port: int
    """The server's ZMQ port on 127.0.0.1."""
    overlay: Path
    """A directory of links to ``lmcache`` and the modules our venv lacks (``build_overlay``)."""


def site_packages(venv: Path) -> Path | None:
    """The venv's site-packages holding ``lmcache``, or None."""
    found = sorted(venv.glob("lib/python3*/site-packages/lmcache"))
    return found[0].parent if found else None


def venv_problem(venv: Path) -> str | None:
    """Why ``venv`` cannot serve as LMCache's venv, or None when it can."""
    if not (venv / "bin" / "python").exists():
        return f"no LMCache venv at {venv} (make setup-lmcache)"
    if site_packages(venv) is None:
        return f"{venv} has no lmcache package (make setup-lmcache)"
    return None


def build_overlay(site: Path, dest: Path, have: Iterable[str] | None = None) -> list[str]:
    """Link ``lmcache`` and every top-level module in ``site`` that this interpreter cannot import into ``dest``.

    Args:
        site: LMCache's site-packages.
        dest: an empty or missing directory.
        have: top-level names this interpreter already imports (default: asked of ``importlib``).

    Returns:
        The linked names, sorted.
    """
    dest.mkdir(parents=True, exist_ok=True)
    present = set(have) if have is not None else None
    linked = []
    for entry in sorted(site.iterdir()):
        name = _module_name(entry)
        if name is None or name in ("pip", "setuptools", "_distutils_hack", "pkg_resources"):
            continue
        ours = name in present if present is not None else importlib.util.find_spec(name) is not None
        if name == "lmcache" or not ours:
            (dest / entry.name).symlink_to(entry.resolve())
            linked.append(name)
    return sorted(set(linked))


def _module_name(entry: Path) -> str | None:
    if entry.name.endswith((".dist-info", ".pth", ".libs")) or entry.name.startswith((".", "__")):
        return None
    if entry.is_dir():
        return entry.name if (entry / "__init__.py").exists() or entry.name.isidentifier() else None
    if entry.suffix in (".py", ".so"):
        return entry.name.split(".")[0]
    return None


def connector_config(side: LMCacheSide) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for its LMCacheMPConnector talking to the server at ``side.port``."""
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": side.port,
                                          "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}


def prepare_engine(side: LMCacheSide) -> None:
    """Make lmcache importable in this (engine) process and guard vLLM's kernel-override scan against it."""
    os.environ["LMCACHE_TRACK_USAGE"] = "false"
    if str(side.overlay) not in sys.path:
        sys.path.append(str(side.overlay))
    guard_kernel_rebind()


def guard_kernel_rebind() -> None:
    """vLLM 0.32's CPU platform rebinds Triton kernels by scanning every module's namespace and calling
    ``vars(value).get("kernel")`` on each value with a ``__dict__``; lmcache imports numba/llvmlite, whose
    ``_lib_fn_wrapper`` objects forward ``__dict__`` to something without ``.get``, and in-process vLLM dies at
    start-up (``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``). The scan's ``vars`` is looked
    up in its module's globals first: give it one that answers ``{}`` for a non-dict ``__dict__`` (such an object
    holds no kernel), and changes nothing for any other value."""
    from vllm.triton_utils import dispatcher

    if not hasattr(dispatcher, "_rebind_kernels") and not hasattr(dispatcher, "_rebind_impls"):
        return  # another vLLM release (the scan is _rebind_kernels up to 0.33, _rebind_impls in 0.34)

    def safe_vars(obj: Any) -> Any:
        namespace = getattr(obj, "__dict__", None)
        return namespace if isinstance(namespace, dict) else {}

    dispatcher.vars = safe_vars  # type: ignore[attr-defined]


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """KV bytes one token occupies over all layers (keys and values): what a one-token load or store moves."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    return int(config["num_hidden_layers"] * 2 * kv_heads * head_dim * _DTYPE_BYTES[dtype])


def server_command(python: Path, port: int, http_port: int, l1_gib: float, chunk_size: int) -> list[str]:
    """LMCache's multiprocess server on loopback: L1 (host RAM) of ``l1_gib``, LRU, ``chunk_size``-token chunks."""
    return [str(python), "-m", SERVER_MODULE, "--host", "127.0.0.1", "--port", str(port),
            "--http-host", "127.0.0.1", "--http-port", str(http_port), "--l1-size-gb", str(l1_gib),
            "--eviction-policy", "LRU", "--chunk-size", str(chunk_size),
            "--supported-transfer-mode", "lmcache_driven", "--disable-metrics"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LMCacheServer:
    """A running LMCache multiprocess server (a context manager: stopped on exit).

    Raises:
        RuntimeError: on entry, when the server exits or is not healthy within ``start_timeout_s``; the message
            carries the tail of its log.
    """

    def __init__(self, venv: Path, l1_gib: float, chunk_size: int, log: Path, start_timeout_s: float = 180.0
                 ) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.command = server_command(venv / "bin" / "python", self.port, self.http_port, l1_gib, chunk_size)
        self.log, self.start_timeout_s = log, start_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LMCacheServer:
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONUNBUFFERED": "1"}
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"the LMCache server exited with {self.process.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError, ValueError):
                if self.status().get("is_healthy"):
                    return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the LMCache server was not healthy after {self.start_timeout_s} s:\n{self.log_tail()}")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def status(self) -> dict[str, Any]:
        """The server's ``GET /status`` document."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/status", timeout=5) as reply:
            doc: dict[str, Any] = json.loads(reply.read())
        return doc

    def l1_used_bytes(self) -> int:
        """Bytes of KV the server holds in its L1 (host RAM) now."""
        return int(self.status()["storage_manager"]["l1_usage"][0])

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server process (all its threads) so far."""
        assert self.process is not None
        return process_cpu_seconds(self.process.pid)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process, from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def leftover_segments(pids: Iterable[int], shm: Path = SHM_DIR) -> Iterator[Path]:
    """LMCache's shared-memory segments (``lmcache_kv_<pid>_*``) of the given processes, once none is alive."""
    for pid in pids:
        if Path(f"/proc/{pid}").exists():
            continue
        yield from sorted(shm.glob(f"lmcache_kv_{pid}_*"))


def remove_segments(pids: Iterable[int], shm: Path = SHM_DIR) -> list[Path]:
    """Remove what ``leftover_segments`` finds; returns the removed paths."""
    removed = []
    for path in leftover_segments(pids, shm):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed
