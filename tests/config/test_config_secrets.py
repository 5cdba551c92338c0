"""Secret and password files as deployments mount them: links followed, then only a private regular file is read."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvoffload.config import ConfigError, OffloadConfig
from kvoffload.config.secrets import MAX_SECRET_FILE_BYTES

DISK = {"disk_path": "/tmp/kvoffload-secret-test"}
SECRET = b"s3cr3t-value-" * 4
FOREIGN_UID = 12345


def write_private(path: Path, value: bytes = SECRET, mode: int = 0o600) -> Path:
    path.write_bytes(value)
    os.chmod(path, mode)
    return path


def parse_secret(path: Path | str) -> bytes:
    config = OffloadConfig.from_dict({**DISK, "tier_secret_file": str(path)})
    assert config.disk is not None and config.disk.secret is not None
    return config.disk.secret.value


def refusal(path: Path | str, key: str = "tier_secret_file") -> str:
    raw = {**DISK, key: str(path)} if key.startswith("tier") else {"remote_url": "redis://kv:6379", key: str(path)}
    with pytest.raises(ConfigError) as err:
        OffloadConfig.from_dict(raw)
    message = str(err.value)
    assert f"{key}='{path}'" in message
    assert SECRET.decode() not in message
    return message


def kubernetes_mount(root: Path, mode: int = 0o600) -> Path:
    """The layout kubelet writes: key -> ..data/key, ..data -> ..<timestamp>/ holding the file."""
    stamped = root / "..2026_01_01_00_00_00.123456789"
    stamped.mkdir()
    write_private(stamped / "tier.key", mode=mode)
    (root / "..data").symlink_to(stamped.name)
    (root / "tier.key").symlink_to("..data/tier.key")
    return root / "tier.key"


def test_a_symlink_to_a_private_file_is_followed(tmp_path: Path) -> None:
    link = tmp_path / "link.key"
    link.symlink_to(write_private(tmp_path / "real.key"))
    assert parse_secret(link) == SECRET


def test_a_kubernetes_secret_mount_chain_of_links_is_followed(tmp_path: Path) -> None:
    assert parse_secret(kubernetes_mount(tmp_path)) == SECRET


def test_a_group_readable_target_behind_links_is_refused(tmp_path: Path) -> None:
    message = refusal(kubernetes_mount(tmp_path, mode=0o640))
    assert "chmod 600" in message and "0640" in message


def refusal_without_hanging(fifo: Path, key: str) -> str:
    """``refusal`` parsed in a thread: an open() that blocks fails the test instead of hanging the suite."""
    outcome: list[str | BaseException] = []

    def parse() -> None:
        try:
            outcome.append(refusal(fifo, key))
        except BaseException as e:  # re-raised in the test's thread
            outcome.append(e)

    thread = threading.Thread(target=parse, daemon=True)
    thread.start()
    thread.join(timeout=10)
    if thread.is_alive():  # unblock the open() with a writer so that the thread ends
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join()
        pytest.fail(f"parsing {key} at a FIFO blocked until a writer opened it")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


@pytest.mark.parametrize("key", ["tier_secret_file", "remote_password_file"])
def test_a_fifo_is_refused_at_once_instead_of_hanging_start_up(tmp_path: Path, key: str) -> None:
    fifo = tmp_path / "secret.fifo"
    os.mkfifo(fifo, 0o600)
    assert "must be a regular file, it is a FIFO" in refusal_without_hanging(fifo, key)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_private_file_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    path = write_private(tmp_path / "tier.key")
    os.chown(path, FOREIGN_UID, -1)
    message = refusal(path)
    assert f"owned by uid {FOREIGN_UID}" in message and f"uid {os.geteuid()}" in message


def test_a_root_owned_file_is_accepted_by_a_non_root_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_private(tmp_path / "tier.key")
    owner = path.stat().st_uid
    if owner != 0:
        pytest.skip("needs a file owned by root (run as root)")
    monkeypatch.setattr(os, "geteuid", lambda: FOREIGN_UID)
    assert parse_secret(path) == SECRET


def test_a_file_of_the_size_limit_is_read_and_one_byte_more_is_refused(tmp_path: Path) -> None:
    largest = b"k" * MAX_SECRET_FILE_BYTES
    assert parse_secret(write_private(tmp_path / "largest.key", largest)) == largest
    message = refusal(write_private(tmp_path / "larger.key", largest + b"k"))
    assert f"larger than {MAX_SECRET_FILE_BYTES} bytes" in message


def test_a_directory_is_refused_as_not_a_regular_file(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    directory.mkdir(mode=0o700)
    assert "it is a directory" in refusal(directory)


def test_a_dangling_link_is_refused_naming_the_key(tmp_path: Path) -> None:
    link = tmp_path / "tier.key"
    link.symlink_to(tmp_path / "absent")
    assert "cannot open the secret file" in refusal(link)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660], ids=oct)
def test_a_password_file_has_the_secret_files_checks(tmp_path: Path, mode: int) -> None:
    path = write_private(tmp_path / "password", mode=mode)
    assert "chmod 600" in refusal(path, key="remote_password_file")


def test_a_password_file_behind_links_is_read(tmp_path: Path) -> None:
    link = kubernetes_mount(tmp_path)
    config = OffloadConfig.from_dict({"remote_url": "redis://kv:6379", "remote_password_file": str(link)})
    assert config.remote is not None and config.remote.password is not None
    assert config.remote.password.value == SECRET
