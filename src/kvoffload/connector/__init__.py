"""What an engine calls each step: the scheduler half and the worker half.

Reading order:

1. ``metadata.py``: the small values that cross between the halves each step (jobs to start and flush; finished
   and failed jobs, stats).
2. ``scheduler.py``: the scheduler half's facade, ``ConnectorScheduler``, which the engine's hooks call; it
   delegates to
   - ``requests.py``: what it reads from the engine, and remembers per request;
   - ``loads.py``: how many prefix tokens the tiers supply, and the load job for them (``load_cost.py``: whether
     loading from a lower tier beats recomputing);
   - ``stores.py``: each step's scan for blocks that became full, and store admission;
   - ``jobs.py``: job ids, the jobs in flight, fences, and what finishing a job means;
   - ``recording.py``: the ``record_trace`` lines.
3. ``worker.py``: the worker half, ``ConnectorWorker``, which runs the jobs on the handlers and reports back.
4. ``stats.py``: the counters both halves keep for users.
"""
