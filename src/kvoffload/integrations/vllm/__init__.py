"""kvoffload inside vLLM (0.32): the ``KVOffloadConnector`` KV connector and its plugin registration.

vLLM loads the connector with::

    kv_transfer_config={"kv_connector": "KVOffloadConnector",
                        "kv_connector_module_path": "kvoffload.integrations.vllm",
                        "kv_role": "kv_both", "kv_connector_extra_config": {...}}

or, once kvoffload is installed, by the name alone (the ``vllm.general_plugins`` entry point registers it).

The connector is imported lazily (PEP 562 ``__getattr__``): importing a sibling module such as
``kvoffload.integrations.vllm.compat`` (which the API checker, ``kvoffload.tools.vllm.api_check``, imports) must
not pay for importing vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVOffloadConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVOffloadConnector":
        from kvoffload.integrations.vllm.connector import KVOffloadConnector

        return KVOffloadConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
