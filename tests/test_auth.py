"""Sealed blocks: seals that only the secret's holders can make and open, names only they can compute, secrets that
are read safely and never shown."""

import os
import random

import pytest

from kvoffload.auth import NONCE_BYTES, TAG_BYTES, BlockAuth, TierSecret
from kvoffload.config import ConfigError, OffloadConfig

SECRET = TierSecret("test", b"s" * 32)
DISK = {"disk_path": "/tmp/kvoffload-auth-test"}


def keys(n, seed=0):
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def test_names_are_a_keyed_permutation_of_keys():
    auth = BlockAuth(SECRET)
    ks = keys(500)
    names = [auth.name(k) for k in ks]
    assert len(set(names)) == len(ks)
    assert all(auth.key_of(n) == k for n, k in zip(names, ks, strict=True))
    assert all(n != k and len(n) == 16 for n, k in zip(names, ks, strict=True))
    other = BlockAuth(TierSecret("other", b"t" * 32))
    assert all(other.name(k) != n for k, n in zip(ks, names, strict=True))


def seal(auth, binding, payload, header=b"h" * 64, nonce=b"n" * NONCE_BYTES):
    out = bytearray(len(payload) + TAG_BYTES)
    auth.seal_into(binding, nonce, header, memoryview(payload), memoryview(out))
    return bytes(out)


def opens(auth, binding, sealed, header=b"h" * 64, nonce=b"n" * NONCE_BYTES):
    out = bytearray(len(sealed) - TAG_BYTES)
    return bytes(out) if auth.open_into(binding, nonce, header, memoryview(sealed), memoryview(out)) else None


def test_a_seal_opens_to_its_payload_and_hides_it():
    auth, payload = BlockAuth(SECRET), bytes(range(256)) * 16
    sealed = seal(auth, b"b" * 32, payload)
    assert opens(auth, b"b" * 32, sealed) == payload
    assert payload[:16] not in sealed and len(sealed) == len(payload) + TAG_BYTES


@pytest.mark.parametrize("change", ["ciphertext", "tag", "header", "nonce", "binding", "secret"])
def test_a_seal_fails_to_open_for_any_changed_byte_binding_or_secret(change):
    auth, payload = BlockAuth(SECRET), bytes(4096)
    sealed = bytearray(seal(auth, b"b" * 32, payload))
    header, nonce, binding, reader = b"h" * 64, b"n" * NONCE_BYTES, b"b" * 32, auth
    if change == "ciphertext":
        sealed[7] ^= 1
    elif change == "tag":
        sealed[-1] ^= 1
    elif change == "header":
        header = b"H" + header[1:]
    elif change == "nonce":
        nonce = b"N" + nonce[1:]
    elif change == "binding":
        binding = b"c" + binding[1:]  # another key, rank or namespace
    else:
        reader = BlockAuth(TierSecret("other", b"t" * 32))
    assert opens(reader, binding, bytes(sealed), header, nonce) is None
    assert opens(auth, b"b" * 32, seal(auth, b"b" * 32, payload)) == payload  # the unchanged seal still opens


def test_nonces_are_fresh_random_bytes():
    nonces = {BlockAuth.new_nonce() for _ in range(1000)}
    assert len(nonces) == 1000 and all(len(n) == NONCE_BYTES for n in nonces)


def test_a_long_secret_works_and_the_directory_name_depends_on_it():
    long_auth = BlockAuth(TierSecret("long", b"x" * 200))
    assert opens(long_auth, b"b", seal(long_auth, b"b", b"p")) == b"p"
    assert long_auth.directory(b"root") != BlockAuth(SECRET).directory(b"root")


def test_the_secret_never_shows_in_repr(tmp_path):
    secret = TierSecret("file /run/kv.key", b"hunter2-hunter2-hunter2")
    assert "hunter2" not in repr(secret)
    config = OffloadConfig.from_dict({**DISK, "tier_secret_file": write_secret(tmp_path / "key", b"hunter2" * 3)})
    assert config.disk is not None and config.disk.secret is not None
    assert "hunter2" not in repr(config)


def write_secret(path, value, mode=0o600):
    path.write_bytes(value)
    os.chmod(path, mode)
    return str(path)


def test_a_secret_file_readable_by_its_owner_only_is_read(tmp_path):
    config = OffloadConfig.from_dict({**DISK, "tier_secret_file": write_secret(tmp_path / "key", b"k" * 32 + b"\n")})
    assert config.disk is not None and config.disk.secret is not None
    assert config.disk.secret.value == b"k" * 32


@pytest.mark.parametrize(("value", "mode", "culprit"), [
    (b"k" * 32, 0o644, "chmod 600"),
    (b"short", 0o600, "at least 16 bytes"),
])  # fmt: skip
def test_a_bad_secret_file_is_a_config_error_that_does_not_show_the_secret(tmp_path, value, mode, culprit):
    path = write_secret(tmp_path / "key", value, mode)
    with pytest.raises(ConfigError, match=culprit) as err:
        OffloadConfig.from_dict({**DISK, "tier_secret_file": path})
    assert "tier_secret_file" in str(err.value) and value.decode() not in str(err.value)


def test_a_missing_secret_file_or_variable_is_a_config_error(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="tier_secret_file"):
        OffloadConfig.from_dict({**DISK, "tier_secret_file": str(tmp_path / "absent")})
    monkeypatch.delenv("KVOFF_TEST_SECRET", raising=False)
    with pytest.raises(ConfigError, match="tier_secret_env"):
        OffloadConfig.from_dict({**DISK, "tier_secret_env": "KVOFF_TEST_SECRET"})
    monkeypatch.setenv("KVOFF_TEST_SECRET", "e" * 20)
    config = OffloadConfig.from_dict({**DISK, "tier_secret_env": "KVOFF_TEST_SECRET"})
    assert config.disk is not None and config.disk.secret is not None
    assert config.disk.secret.value == b"e" * 20
    with pytest.raises(ConfigError, match="without a shared tier"):
        OffloadConfig.from_dict({"tier_secret_env": "KVOFF_TEST_SECRET"})
    with pytest.raises(ConfigError, match="not both"):
        OffloadConfig.from_dict({**DISK, "tier_secret_env": "KVOFF_TEST_SECRET",
                                 "tier_secret_file": write_secret(tmp_path / "key", b"k" * 32)})
