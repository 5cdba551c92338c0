"""kvoffload's tools: the ``kvoffload`` command (``cli.py``), the benchmarks (``bench/``), trace replay and tier
sizing (``replay/``) and the vLLM tools (``vllm/``: the demo and its model writer, the LMCache peer, CPU binding and
the vLLM API checker).

They use the product core (the connector, the tiers, the vLLM adapter in ``kvoffload.integrations``); the core never
imports them.
"""
