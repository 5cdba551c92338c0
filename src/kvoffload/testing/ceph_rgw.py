"""A real S3 server for tests: a single-node Ceph cluster with radosgw, on 127.0.0.1, in a directory of its own.

``CephRGW(directory)`` bootstraps one monitor, one BlueStore OSD on a sparse file, no manager and no cephx, an S3
user with random keys, and radosgw (beast frontend) on a free port; it returns once radosgw answers an S3 request
signed with those keys (16-20 s on 2 cores; the first CreateBucket takes 2-4 s more: it creates the bucket pools).
Every path the daemons use (config, data, logs, sockets, PID files) lies under the directory. The daemons are
children of this process, each in its own session; ``stop()``, the end of a ``with`` block or this interpreter's
exit stops and reaps them. Fault injection: ``kill_rgw()`` / ``start_rgw()`` (the data stays), ``stop_osd()`` /
``start_osd()`` (SIGSTOP: every request then hangs, with no error, until the client's timeout; ``hard=True``: a
real stop and start). Needs Debian's ``radosgw ceph-mon ceph-osd ceph-common`` (``make setup-ceph``). No kvoffload
code needs this module at serving time.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import hashlib
import hmac
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import urllib.request
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from kvoffload.testing.redis_server import free_ports

BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "ceph-authtool", "monmaptool")
START_TIMEOUT_S = 90.0  # measured 17-24 s on 2 cores, 34 s under heavy load
STOP_TIMEOUT_S = 10.0  # SIGTERM, then SIGKILL: radosgw ignores SIGTERM while an OSD op hangs
MON, OSD, RGW = "mon.a", "osd.0", "client.rgw.a"


class CephUnavailable(RuntimeError):
    """A Ceph binary is missing (``make setup-ceph`` installs Debian's packages)."""


class CephStartError(RuntimeError):
    """The cluster or radosgw did not come up in time; the message holds the tail of the daemons' logs."""


@dataclass(frozen=True)
class S3Credentials:
    """Where the S3 server is (``http://127.0.0.1:PORT``: path-style addressing only, no wildcard DNS here) and who
    to be there. radosgw takes any region name."""

    endpoint: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"


class CephRGW:
    """One mon, one OSD and radosgw in ``directory`` (new or empty), all on 127.0.0.1.

    Args:
        directory: where everything goes; keep its path short (Unix socket paths under it must fit 107 bytes).
        osd_bytes: the size of the OSD's sparse block file (only what is written takes disk space).
        start_timeout_s: the deadline for the whole bootstrap, and for each ``start_rgw`` / ``start_osd``.
    Raises:
        CephUnavailable: a binary is missing.
        CephStartError: not answering by the deadline (every daemon started is stopped first).
    """

    def __init__(self, directory: Path | str, osd_bytes: int = 4 << 30,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.directory = Path(directory).resolve()
        if self.directory.exists() and any(self.directory.iterdir()):
            raise ValueError(f"{self.directory} is not empty: a cluster is bootstrapped in a new directory")
        missing = [name for name in BINARIES if shutil.which(name) is None]
        if missing:
            raise CephUnavailable(f"{', '.join(missing)} not installed: run `make setup-ceph` (as root: apt-get "
                                  "install --no-install-recommends radosgw ceph-mon ceph-osd ceph-common)")
        self.conf = self.directory / "ceph.conf"
        self.start_timeout_s = start_timeout_s
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._frozen = False
        self._osd_since = 0  # the osdmap epoch the running OSD came up in
        # Stops the daemons if this object is dropped or the interpreter exits without stop() (not on SIGKILL:
        # then run/*.pid says what is left).
        self._finalizer = weakref.finalize(self, _stop_all, self._procs)
        mon_v2, mon_v1, rgw_port = free_ports(3)
        self.credentials = S3Credentials(f"http://127.0.0.1:{rgw_port}", "TEST" + secrets.token_hex(8).upper(),
                                         secrets.token_urlsafe(30))
        c = self.credentials  # the same as plain attributes, for brevity in tests
        self.endpoint, self.access_key, self.secret_key, self.region = c.endpoint, c.access_key, c.secret_key, c.region
        try:
            self._bootstrap(mon_v2, mon_v1, rgw_port, osd_bytes)
        except BaseException:
            self.stop()
            raise

    # ---- fault injection --------------------------------------------------------------------------------------

    def kill_rgw(self) -> None:
        """SIGKILL radosgw, as a crash would: requests are refused until ``start_rgw()``."""
        _stop(self._procs.pop(RGW, None), term_timeout_s=0)

    def running(self) -> dict[str, int]:
        """The PIDs of the daemons not exited (a frozen OSD included) by name: mon.a, osd.0, client.rgw.a."""
        return {name: proc.pid for name, proc in self._procs.items() if proc.poll() is None}

    def start_rgw(self) -> None:
        """Start radosgw again (after ``kill_rgw``, or a crash) on the same port; returns once it answers. The
        data stays. A no-op but for the check while it runs."""
        if RGW not in self.running():
            self._spawn(RGW, "radosgw", "-n", RGW)
        self._wait(RGW, self._rgw_answers, time.monotonic() + self.start_timeout_s)

    def stop_osd(self, hard: bool = False) -> None:
        """Freeze the OSD (SIGSTOP): every request touching data hangs until ``start_osd()``; radosgw sends no
        error, so only a client's timeout ends it. ``hard=True`` stops the process instead (SIGTERM: it tells the
        monitor it is going down)."""
        proc = self._procs.get(OSD)
        if hard:
            self._frozen = False
            _stop(self._procs.pop(OSD, None))
        elif proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGSTOP)
            self._frozen = True

    @property
    def osd_stopped(self) -> bool:
        """The OSD is frozen by ``stop_osd()`` (and not thawed yet)."""
        return self._frozen

    def start_osd(self) -> None:
        """Undo ``stop_osd``: thaw the frozen OSD, or start a stopped (or crashed) one and wait until the monitor
        has it up. A no-op while it runs."""
        if self._frozen:
            os.kill(self._procs[OSD].pid, signal.SIGCONT)
            self._frozen = False
        elif OSD not in self.running():
            self._spawn(OSD, "ceph-osd", "-i", "0")
            self._wait_osd(time.monotonic() + self.start_timeout_s)

    # ---- stopping ---------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop radosgw, the OSD, then the monitor (SIGTERM, SIGKILL after ``STOP_TIMEOUT_S``), each reaped.
        Idempotent; the directory and its data stay."""
        _stop_all(self._procs)
        self._frozen = False

    def __enter__(self) -> CephRGW:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    # ---- bootstrap --------------------------------------------------------------------------------------------

    def _bootstrap(self, mon_v2: int, mon_v1: int, rgw_port: int, osd_bytes: int) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        d = self.directory
        for sub in ("run", "log", "mon", "osd/ceph-0", "rgw", "crash"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        fsid, mon_addrs = str(uuid.uuid4()), f"[v2:127.0.0.1:{mon_v2},v1:127.0.0.1:{mon_v1}]"
        self.conf.write_text(_config(d, fsid, mon_addrs, rgw_port, osd_bytes))
        self._run("ceph-authtool", "--create-keyring", str(d / "keyring"), "--gen-key", "-n", "mon.",
                  "--cap", "mon", "allow *")
        self._run("monmaptool", "--create", "--fsid", fsid, "--addv", "a", mon_addrs, str(d / "monmap"))
        self._run("ceph-mon", "-c", str(self.conf), "--mkfs", "-i", "a", "--monmap", str(d / "monmap"),
                  "--keyring", str(d / "keyring"))
        self._spawn(MON, "ceph-mon", "-i", "a")
        self._wait(MON, lambda: self._ceph("mon", "stat") is not None, deadline)
        osd_uuid = str(uuid.uuid4())
        self._run("ceph", "-c", str(self.conf), "osd", "new", osd_uuid)
        self._run("ceph-osd", "-c", str(self.conf), "-i", "0", "--mkfs", "--osd-uuid", osd_uuid)
        self._spawn(OSD, "ceph-osd", "-i", "0")
        self._wait_osd(deadline)
        # The user first (radosgw-admin works on RADOS directly, creating the zone and its pools: the longest
        # step), so that radosgw's readiness is an S3 request signed with the user's keys.
        self._run("radosgw-admin", "-c", str(self.conf), "-n", RGW, "user", "create", "--uid=test",
                  "--display-name=test", f"--access-key={self.access_key}", f"--secret-key={self.secret_key}")
        self._spawn(RGW, "radosgw", "-n", RGW)
        self._wait(RGW, self._rgw_answers, deadline)

    def _spawn(self, name: str, binary: str, *args: str) -> None:
        """A daemon in the foreground (``-f``: no fork, so the PID is ours to signal and reap), own session."""
        with (self.directory / "log" / f"{name}.stdout").open("ab") as out:
            proc = subprocess.Popen([binary, "-f", "-c", str(self.conf), *args], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self._procs[name] = proc
        (self.directory / "run" / f"{name}.pid").write_text(f"{proc.pid}\n")

    def _run(self, *args: str) -> str:
        done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise CephStartError(f"{' '.join(args[:4])} ... failed ({done.returncode}):\n{done.stderr[-2000:]}"
                                 f"{self._log_tails()}")
        return done.stdout

    def _ceph(self, *args: str) -> str | None:
        """A ``ceph`` command's output, or None if the monitor did not answer within a few seconds."""
        try:
            done = subprocess.run(["ceph", "-c", str(self.conf), "--connect-timeout", "3", *args],
                                  capture_output=True, text=True, timeout=10, check=False)
        except subprocess.TimeoutExpired:
            return None
        return done.stdout if done.returncode == 0 else None

    def _wait_osd(self, deadline: float) -> None:
        """Until the monitor has the OSD up since a later epoch than before: an OSD killed without telling the
        monitor still shows up in the map until the new one boots."""
        before = self._osd_since
        self._wait(OSD, lambda: self._osd_up_from() > before, deadline)
        self._osd_since = self._osd_up_from()

    def _osd_up_from(self) -> int:
        """The osdmap epoch osd.0 came up in, or 0 while it is down (or the monitor does not answer)."""
        dump = self._ceph("osd", "dump", "--format=json")
        osds = json.loads(dump).get("osds", []) if dump is not None else []
        return next((int(o["up_from"]) for o in osds if o["osd"] == 0 and o["up"]), 0)

    def _rgw_answers(self) -> bool:
        """Whether a ListBuckets as the user succeeds (AWS signature v2, which radosgw takes: a few lines here,
        where v4 would need an S3 client in the package)."""
        date = email.utils.formatdate(usegmt=True)
        signature = hmac.new(self.secret_key.encode(), f"GET\n\n\n{date}\n/".encode(), hashlib.sha1).digest()
        request = urllib.request.Request(self.endpoint + "/", headers={
            "Date": date, "Authorization": f"AWS {self.access_key}:{base64.b64encode(signature).decode()}"})
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                return bool(response.status == 200)
        except OSError:  # refused, timed out, or an HTTP error (urllib's HTTPError is an OSError)
            return False

    def _wait(self, name: str, ready: Callable[[], bool], deadline: float) -> None:
        while not ready():
            proc = self._procs[name]
            if proc.poll() is not None:
                raise CephStartError(f"{name} exited with {proc.returncode} while starting{self._log_tails()}")
            if time.monotonic() > deadline:
                raise CephStartError(f"{name} not ready within {self.start_timeout_s:.0f} s{self._log_tails()}")
            time.sleep(0.2)  # polling a daemon's start-up

    def _log_tails(self, chars: int = 1500) -> str:
        tails = []
        for path in sorted((self.directory / "log").glob("*")):
            text = path.read_text(errors="replace").strip()
            if text:
                tails.append(f"\n--- {path.name} (tail) ---\n{text[-chars:]}")
        return "".join(tails)


def _config(d: Path, fsid: str, mon_addrs: str, rgw_port: int, osd_bytes: int) -> str:
    return f"""\
[global]
fsid = {fsid}
mon host = {mon_addrs}
public addr = 127.0.0.1
cluster addr = 127.0.0.1
# No cephx: nothing here needs keys, and it keeps every client's set-up to this file.
auth cluster required = none
auth service required = none
auth client required = none
keyring = {d}/keyring
run dir = {d}/run
crash dir = {d}/crash
admin socket = {d}/run/$cluster-$name.asok
log file = {d}/log/$name.log
mon cluster log file = {d}/log/cluster.log
# One OSD: pools of one copy, placed across OSDs rather than hosts, a fixed PG count (no mgr to autoscale).
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
# A nearly full host disk must not stop the monitor (it refuses to run below 5 % free by default).
mon data avail warn = 2
mon data avail crit = 1
# A radosgw killed by a test leaves its watches on the control objects until the OSD times them out (30 s by
# default): until then every metadata write (CreateBucket, ...) waits on notifies the dead one never answers.
# Clients ping their watches every objecter tick (5 s by default): tick each second, time out after 5 s.
objecter tick interval = 1
[mon]
mon data = {d}/mon/$cluster-$id
[osd]
osd data = {d}/osd/$cluster-$id
# BlueStore on a sparse file survives restarts and SIGKILL; memstore would hold everything in the OSD's RAM.
osd objectstore = bluestore
bluestore block path = {d}/osd/block
bluestore block create = true
bluestore block size = {osd_bytes}
osd memory target = 1073741824
osd client watch timeout = 5
[{RGW}]
rgw data = {d}/rgw
# tcp_nodelay: beast writes a response's headers and body apart; with Nagle on, a small body waits for the client's
# delayed ACK, and every GET of a small object or an error (a miss) took 44 ms instead of 2.
rgw frontends = beast endpoint=127.0.0.1:{rgw_port} tcp_nodelay=1
rgw thread pool size = 64
# Lifecycle threads make SIGTERM take ~10 s after a restart; turn them on where a test needs expiry.
rgw enable lc threads = false
# radosgw's own defaults are cephx and a 'secure' monitor connection, which a cluster without cephx cannot
# offer: without these two it hangs at start-up, logging "get_initial_auth_request returned -13" every 3 s.
auth client required = none
ms mon client mode = crc secure
"""


def _stop(proc: subprocess.Popen[bytes] | None, term_timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, then SIGKILL after ``term_timeout_s`` (at once if 0), to the daemon's whole session; reaped."""
    if proc is None or proc.poll() is not None:
        return
    if term_timeout_s > 0:
        _signal_group(proc.pid, signal.SIGTERM)
        _signal_group(proc.pid, signal.SIGCONT)  # a frozen daemon acts on SIGTERM only once it runs again
        try:
            proc.wait(timeout=term_timeout_s)
            return
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def _stop_all(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for name in (RGW, OSD, MON):  # clients first: radosgw before the OSD, the OSD before the monitor
        _stop(procs.pop(name, None))


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # start_new_session: the group's id is the daemon's PID
        os.killpg(pid, sig)

