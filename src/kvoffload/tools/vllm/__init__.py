"""The tools that drive real vLLM: the demo (``demo.py``, ``demo_engine.py``, ``demo_report.py``), the tiny models it
writes (``model.py``), the LMCache peer it runs beside kvoffload (``peer_lmcache.py``), the CPU binding of its
engines and of the benchmarks' (``cpu_binding.py``), and the check of vLLM's API against the one the adapter uses
(``api_check.py``, ``api_source.py``, ``api_surface.py``). The adapter itself is ``kvoffload.integrations.vllm``.
"""
