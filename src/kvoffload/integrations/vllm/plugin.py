"""vLLM plugin: registers ``KVOffloadConnector`` by name, so ``{"kv_connector": "KVOffloadConnector"}`` suffices.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes before it builds a connector;
pyproject.toml points ours at ``register``. Registration is lazy (vLLM imports the connector module only when the
name is used) and idempotent (vLLM may load plugins more than once per process).
"""

from __future__ import annotations

import logging

CONNECTOR_NAME = "KVOffloadConnector"
CONNECTOR_MODULE = "kvoffload.integrations.vllm.connector"

logger = logging.getLogger(__name__)


def register() -> None:
    """Register the connector with vLLM's ``KVConnectorFactory`` unless the name is taken already."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:
        logger.debug("%s is already registered with vLLM", CONNECTOR_NAME)
