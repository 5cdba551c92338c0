"""Fault-injection keys are loud: the worker half that applies one warns once, naming the key and what it does."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvoffload.config import FAULT_KEYS, KEYS, OffloadConfig
from kvoffload.connector.worker import ConnectorWorker
from kvoffload.keys import Namespace
from kvoffload.testing.layouts import attention_layout

WORKER_LOGGER = "kvoffload.tiers.stack"  # where the worker's device<->host handler is built


def start_worker(**config: Any) -> ConnectorWorker:
    layout, make_kv = attention_layout(num_blocks=8, block_size=4)
    worker = ConnectorWorker(OffloadConfig.from_dict({"host_bytes": 1 << 20, **config}), layout, 4,
                             Namespace("m", "fp16", layout.describe()))
    worker.register_kv_caches(make_kv())
    return worker


def fault_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == WORKER_LOGGER and r.levelno == logging.WARNING and "FAULT INJECTION" in r.getMessage()]


def test_every_inject_key_is_a_fault_key_and_a_config_field() -> None:
    assert set(FAULT_KEYS) == {key for key in KEYS if key.startswith("inject_")}
    assert {"inject_load_failures", "inject_load_corruption"} <= set(FAULT_KEYS)
    assert all(hasattr(OffloadConfig(), key) for key in FAULT_KEYS)


@pytest.mark.parametrize("key", FAULT_KEYS)
def test_a_worker_applying_a_fault_key_warns_once_naming_it_and_what_it_does(
        key: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvoffload")
    start_worker(**{key: 3}).shutdown()
    warnings = fault_warnings(caplog)
    assert len(warnings) == 1
    assert f"{key}=3" in warnings[0] and KEYS[key][1] in warnings[0]


def test_each_fault_key_set_gets_its_own_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvoffload")
    start_worker(**dict.fromkeys(FAULT_KEYS, 1)).shutdown()
    assert sorted(w.split(": ", 1)[1].split("=")[0] for w in fault_warnings(caplog)) == sorted(FAULT_KEYS)


def test_a_worker_without_fault_keys_warns_of_none(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvoffload")
    start_worker(**dict.fromkeys(FAULT_KEYS, 0)).shutdown()
    assert fault_warnings(caplog) == []


def test_parsing_alone_warns_of_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """The scheduler half (and metrics, and tools) parse the same keys but apply none of them."""
    caplog.set_level(logging.WARNING, logger="kvoffload")
    OffloadConfig.from_dict(dict.fromkeys(FAULT_KEYS, 1))
    assert caplog.records == []
