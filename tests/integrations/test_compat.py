"""The tested vLLM range: which versions are refused, the override, and the connector refusing at start-up."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.integrations.vllm import compat
from kvoffload.integrations.vllm.compat import ALLOW_UNTESTED_ENV, UntestedVLLMError


@pytest.mark.parametrize(("version", "expected"), [
    ("0.32.0", (0, 32, 0)),
    ("0.32.0+cpu", (0, 32, 0)),
    ("0.32.1.dev3+g1234abc", (0, 32, 1)),
    ("0.33.0rc1", (0, 33, 0)),
    ("1.0", (1, 0, 0)),
    ("dev", None),
    ("", None),
])
def test_release_is_the_numbers_a_version_starts_with(version: str, expected: tuple[int, int, int] | None) -> None:
    assert compat.release(version) == expected


@pytest.mark.parametrize("version", ["0.31.0", "0.31.2", "0.32.0", "0.32.0+cpu", "0.32.1.dev3+g1234abc", "0.33.0",
                                     "0.34.0", "0.34.1rc1"])
def test_releases_of_the_tested_series_are_accepted(version: str) -> None:
    assert compat.untested_reason(version) is None
    compat.require_tested_vllm(version, {})  # returns: nothing to refuse


@pytest.mark.parametrize("version", ["0.30.2", "0.35.0", "0.35.0rc1", "0.35.0.dev12+gabc", "1.0.0", "dev"])
def test_versions_outside_the_tested_range_are_refused_naming_the_range_and_the_override(version: str) -> None:
    with pytest.raises(UntestedVLLMError) as raised:
        compat.require_tested_vllm(version, {})

    message = str(raised.value)
    assert version in message
    assert "0.31 to 0.34" in message
    assert f"{ALLOW_UNTESTED_ENV}=1" in message
    assert "pip install 'vllm>=0.31,<0.35'" in message


def test_the_vllm_extra_admits_exactly_the_tested_range() -> None:
    """``pip install kvoffload[vllm]`` and the refusal's advice name the same releases as ``TESTED_RANGE``."""
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["vllm"] == [compat.tested_requirement()]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def warnings_logged() -> Iterator[list[logging.LogRecord]]:
    """compat's warnings, caught at its own logger: once a connector is built in this process, kvoffload's logger
    no longer propagates to the root, where caplog listens (logs.join_vllm_logging)."""
    logger, handler = logging.getLogger(compat.__name__), _Records()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.mark.parametrize("value", ["1", "true", "YES"])
def test_the_override_turns_the_refusal_into_one_warning(value: str,
                                                         warnings_logged: list[logging.LogRecord]) -> None:
    compat.require_tested_vllm("0.35.0", {ALLOW_UNTESTED_ENV: value})

    [record] = warnings_logged
    assert record.levelno == logging.WARNING
    assert "0.35.0" in record.getMessage() and "0.31 to 0.34" in record.getMessage()


@pytest.mark.parametrize("value", ["0", "", "no"])
def test_an_override_that_is_not_yes_refuses(value: str) -> None:
    with pytest.raises(UntestedVLLMError):
        compat.require_tested_vllm("0.35.0", {ALLOW_UNTESTED_ENV: value})


def test_the_tested_range_is_what_the_docs_say() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    assert f"vLLM {compat.tested_range_text()}" in doc
    assert ALLOW_UNTESTED_ENV in doc


# ---- the connector -----------------------------------------------------------------------------------------


@pytest.fixture
def connector_cls(monkeypatch: pytest.MonkeyPatch) -> Any:
    vllm = pytest.importorskip("vllm")
    from kvoffload.integrations.vllm.connector import KVOffloadConnector

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    return KVOffloadConnector


def test_the_connector_refuses_an_untested_vllm_before_it_reads_any_config(connector_cls: Any) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    with pytest.raises(UntestedVLLMError, match=r"vLLM 0\.35\.0 is outside .* \(vLLM 0\.31 to 0\.34\)"):
        connector_cls(None, KVConnectorRole.SCHEDULER, None)


def test_with_the_override_the_connector_starts_on_an_untested_vllm(
        connector_cls: Any, monkeypatch: pytest.MonkeyPatch, vllm_configs: tuple[Any, Any],
        warnings_logged: list[logging.LogRecord]) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vllm_config, kv_cache_config = vllm_configs
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")

    connector = connector_cls(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)

    assert connector.scheduler.block_tokens == 32
    assert [r.levelno for r in warnings_logged if "0.35.0" in r.getMessage()] == [logging.WARNING]


def test_the_connector_says_no_to_sleep_mode(connector_cls: Any) -> None:
    # vLLM 0.33 asks the class before it builds one; older releases never ask.
    assert connector_cls.supports_sleep_mode(None) is False


@pytest.mark.parametrize("by", ["module path", "registered name"])
def test_the_class_vllms_factory_resolves_says_no_to_sleep_mode(vllm_configs: tuple[Any, Any], by: str) -> None:
    # vLLM 0.33's VllmConfig._verify_kv_transfer_compat asks the class its factory resolves for the configured
    # connector, before any is built, and its default says yes (api_surface.CALL_ORDERS checks that vLLM asks).
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvoffload.integrations.vllm import plugin

    transfer = vllm_configs[0].kv_transfer_config
    if by == "registered name":
        plugin.register()
        transfer.kv_connector_module_path = None

    connector_class = KVConnectorFactory.get_connector_class(transfer)

    assert connector_class.__name__ == "KVOffloadConnector"
    assert connector_class.supports_sleep_mode(transfer) is False
