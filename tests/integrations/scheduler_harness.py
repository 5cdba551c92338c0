"""vLLM's real scheduler driving kvoffload's connector, with a stand-in model runner that checks every loaded byte.

vLLM's own ``Scheduler`` (and its ``KVCacheManager``) admits, allocates, preempts and asks the scheduler-role
``KVOffloadConnector``, which it builds itself from ``KVTransferConfig``, as in an engine. A second connector in
the worker role gets real KV tensors (vLLM's ``allocate_kv_cache`` for the ``KVCacheConfig``) and is driven each
step exactly as vLLM's model runner drives one (``Engine.run_worker_step``, the one place that order lives).

The forward pass is a stand-in (``StandInModel``). For every position a step computes it writes, at the slot the
request's block table gives, bytes that are a function of (the token prefix up to that position, the layer, the
position). It first reads every earlier position the step attends to and compares it with what recomputing would
have written: a mismatch is a wrong load (or a wrong block table), recorded in ``Engine.wrong``. The sampled token
depends on the bytes read, so a wrong load also changes the output, which ``StandInModel.reference`` predicts.

No engine and no model weights: the ``VllmConfig`` is built directly with ``DeviceConfig("cpu")``, as vLLM's own
connector unit tests do (tests/v1/kv_connector/unit/utils.py), so this also runs on vLLM releases without a CPU
build (0.33, 0.34; 0.31 too). What differs between releases is in ``model_runner_output``, and nowhere else.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvoffload.integrations.vllm import compat
from kvoffload.integrations.vllm.connector import KVOffloadConnector
from kvoffload.integrations.vllm.metrics import KVOffloadStats
from kvoffload.tools.vllm.model import ModelFamily, TinyShape, hf_config

VOCAB = 1000
HEADS, HEAD_SIZE = 1, 16  # KV bytes per token and layer: 2 * 16 * 4 = 128 (float32), little to write and check
NULL_BLOCK = 0  # vLLM's block pool hands out block 0 as the placeholder for blocks a group dropped
_M64 = (1 << 64) - 1


# ---- what differs between vLLM 0.32, 0.33 and 0.34 -----------------------------------------------------------


def model_runner_output(req_ids: list[str], sampled: list[list[int]],
                        kv_output: KVConnectorOutput | None) -> ModelRunnerOutput:
    """The step's ``ModelRunnerOutput``. vLLM 0.34 dropped ``req_id_to_index`` (its scheduler derives it from
    ``req_ids``); 0.32 and 0.33 require it. (0.34 also re-sends a resumed request among the new ones, where 0.32
    and 0.33 list it in ``resumed_req_ids``; ``Engine.update_tables`` drops a preempted request's table, so a
    request whose table it does not hold gets its whole table in every release, and it needs neither.)"""
    extra: dict[str, Any] = {}
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        extra["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=kv_output, **extra)


# ---- configuration -------------------------------------------------------------------------------------------


def write_model_config(directory: Path) -> Path:
    """A tiny Llama's ``config.json`` (no weights: nothing runs it; vLLM's ``ModelConfig`` and kvoffload's key
    namespace read it)."""
    import json

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(ModelFamily.LLAMA, TinyShape(vocab_size=VOCAB))))
    return directory


def make_vllm_config(model: Path, *, block_size: int = 16, num_blocks: int = 64, max_model_len: int = 256,
                     max_num_seqs: int = 8, max_num_batched_tokens: int = 64, host_bytes: int = 1 << 21,
                     extra: Mapping[str, Any] | None = None, speculative: Mapping[str, Any] | None = None,
                     scheduler: Mapping[str, Any] | None = None, kv_events: bool = False) -> VllmConfig:
    """A ``VllmConfig`` with kvoffload configured, built without an engine (``DeviceConfig("cpu")``);
    ``kv_events``: vLLM's scheduler publishes KV events (to its "null" publisher; a test swaps in a recorder)."""
    model_config = ModelConfig(model=str(model), dtype="float32", max_model_len=max_model_len,
                               skip_tokenizer_init=True, seed=0)
    transfer = KVTransferConfig(kv_connector="KVOffloadConnector",
                                kv_connector_module_path="kvoffload.integrations.vllm.connector", kv_role="kv_both",
                                kv_connector_extra_config={"host_bytes": host_bytes, **(extra or {})})
    spec_config = None
    if speculative is not None:
        from vllm.config import ParallelConfig, SpeculativeConfig

        spec_config = SpeculativeConfig(**speculative, target_model_config=model_config,
                                        target_parallel_config=ParallelConfig())
    # Synchronous steps (schedule, execute, update), as EngineCore.step runs them without async scheduling.
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=max_model_len, enable_chunked_prefill=True, is_encoder_decoder=False,
                            async_scheduling=False, **(scheduler or {}))
    config = VllmConfig(model_config=model_config, scheduler_config=sched, device_config=DeviceConfig("cpu"),
                        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True,
                                                 num_gpu_blocks_override=num_blocks),
                        kv_transfer_config=transfer, speculative_config=spec_config,
                        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null")
                        if kv_events else None)
    config.cache_config.kv_cache_layout = "LBNHC"  # what the CPU backend resolves; no worker runs to resolve it
    return config


def attention(block_size: int, window: int | None = None) -> KVCacheSpec:
    """A float32 attention layer's spec: full, or sliding-window over ``window`` tokens."""
    if window is None:
        return FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32,
                             sliding_window=window)


def full_attention(num_layers: int, block_size: int = 16) -> dict[str, KVCacheSpec]:
    """Llama-style layers: every one full attention."""
    return {f"model.layers.{i}.self_attn.attn": attention(block_size) for i in range(num_layers)}


def make_engine(model: Path, specs: Mapping[str, KVCacheSpec], **config: Any) -> Engine:
    """An ``Engine`` for layers ``blocks`` (their block size is the engine's); ``config``: ``make_vllm_config``'s."""
    block_size = next(iter(specs.values())).block_size
    vllm_config = make_vllm_config(model, block_size=block_size, **config)
    if len({type(spec) for spec in specs.values()}) > 1:
        # Several KV-cache groups need vLLM's hybrid manager, which VllmConfig turns off where it finds no platform
        # (0.33 and 0.34 here: no CPU build, so UnspecifiedPlatform); the scheduler's side of it needs no device.
        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    if any(isinstance(spec, MambaSpec) for spec in specs.values()):
        vllm_config.cache_config.mamba_cache_mode = "align"  # what vLLM picks with prefix caching on
    return Engine(vllm_config, plan_kv_cache(vllm_config, specs))


def plan_kv_cache(config: VllmConfig, specs: Mapping[str, KVCacheSpec]) -> KVCacheConfig:
    """vLLM's own plan for these layers, as the engine core makes it (and the block count it tells the scheduler)."""
    kv_cache_config = compat.get_kv_cache_configs(config, [dict(specs)], [1 << 30])[0]
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return kv_cache_config


# ---- the stand-in forward pass -------------------------------------------------------------------------------


def mix(a: int, b: int) -> int:
    """A 62-bit hash of two ints (splitmix64's finaliser): the same in every process, unlike ``hash()``."""
    x = (a * 0x9E3779B97F4A7C15 + b + 0x632BE59BD9B4E019) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return (x ^ (x >> 31)) >> 2


def prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """``h[p]``: the hash of ``tokens[:p + 1]``."""
    out, h = [], 7
    for t in tokens:
        h = mix(h, t + 2)
        out.append(h)
    return out


class LayerKV(NamedTuple):
    """One layer's KV as the stand-in sees it: ``pages[block]`` is the block's bytes ``[heads, tokens, bytes]``
    (attention) or ``[1, 1, state bytes]`` (a state layer); ``window`` in tokens for sliding-window layers."""

    name: str
    ordinal: int
    group: int
    pages: torch.Tensor
    window: int | None
    state: bool

    def width(self, block_size: int) -> int:
        """Bytes of one position (attention) or of the state (a state layer)."""
        return self.pages[0].numel() // (1 if self.state else block_size)


@dataclass(frozen=True)
class WrongKV:
    """A position whose bytes the forward pass read are not what recomputing would have written (``"differs"``), or
    that it found (``"null block"``) or had to write (``"write to null block"``) in vLLM's null block."""

    req_id: str
    layer: str
    position: int
    block: int
    reason: str


class StandInModel:
    """Writes and reads the real KV tensors through block tables; samples from what it read."""

    def __init__(self, kv_cache_config: KVCacheConfig, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.layers: list[LayerKV] = []
        for g, group in enumerate(kv_cache_config.kv_cache_groups):
            for name in group.layer_names:
                spec = group.kv_cache_spec
                spec = getattr(spec, "kv_cache_specs", {}).get(name, spec)
                pages = kv_caches[name]
                pages = pages if pages.dtype == torch.int8 else pages.view(torch.int8)
                window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
                self.layers.append(LayerKV(name, len(self.layers), g, pages, window, isinstance(spec, MambaSpec)))
        self._cols = torch.arange(max(layer.width(self.block_size) for layer in self.layers), dtype=torch.int64)
        self._weights = self._cols * 7919 % 997 + 1

    # -- bytes ----------------------------------------------------------------------------------------------

    def pattern(self, hashes: torch.Tensor, layer: LayerKV) -> torch.Tensor:
        """The bytes recomputing writes for these prefixes in ``layer``: ``[len(hashes), width]`` int8."""
        cols = self._cols[:layer.width(self.block_size)]
        v = (hashes[:, None] >> (cols % 53)) + cols * 37 + layer.ordinal * 101
        return (v & 255).to(torch.uint8).view(torch.int8)

    def digest(self, rows: torch.Tensor) -> torch.Tensor:
        """What the sampled token takes from each row of bytes read (an int64 per row)."""
        return (rows.to(torch.int64) * self._weights[:rows.shape[1]]).sum(dim=1)

    def _slots(self, layer: LayerKV, table: Sequence[int], positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        """Block and offset of each position: its column of the table (a state layer: the column the state after
        ``position + 1`` tokens lives in, the same)."""
        blocks = torch.tensor([table[p // self.block_size] for p in positions], dtype=torch.int64)
        offsets = torch.tensor([p % self.block_size for p in positions], dtype=torch.int64)
        return blocks, offsets

    def _read(self, layer: LayerKV, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if layer.state:
            return layer.pages[blocks].reshape(len(blocks), -1)
        return layer.pages[blocks, :, offsets, :].reshape(len(blocks), -1)

    def _write(self, layer: LayerKV, blocks: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor) -> None:
        if layer.state:
            layer.pages[blocks] = rows.reshape(len(blocks), *layer.pages.shape[1:])
        else:
            layer.pages[blocks, :, offsets, :] = rows.reshape(len(blocks), layer.pages.shape[1], -1)

    # -- one request's part of a step -----------------------------------------------------------------------

    def run(self, req_id: str, tokens: Sequence[int], known: int, start: int, count: int,
            tables: Sequence[Sequence[int]], wrong: list[WrongKV]) -> list[int]:
        """Compute positions ``start .. start + count - 1`` of ``tokens``, whose first ``known`` are the request's
        and the rest the step's draft tokens; return the sampled tokens: none for a prefill chunk, else the last
        known token's successor and, while they match the drafts, the drafts' successors (greedy verification)."""
        end = start + count
        hashes = torch.tensor(prefix_hashes(tokens[:end]), dtype=torch.int64)
        digests: list[tuple[LayerKV, int, torch.Tensor]] = []  # per attention layer: first position, digests
        for layer in self.layers:
            table = tables[layer.group]
            # What this step attends to: every earlier position, the window's in a sliding-window layer, the
            # state it starts from in a state layer.
            if layer.state:
                lo, written = max(0, start - 1), range(end - 1, end)
            else:
                lo, written = (0 if layer.window is None else max(0, start - layer.window + 1)), range(start, end)
            read = self.check(req_id, layer, table, range(lo, start), hashes, wrong)
            blocks, offsets = self._slots(layer, table, written)
            for i in (blocks == NULL_BLOCK).nonzero().flatten().tolist():
                wrong.append(WrongKV(req_id, layer.name, written[i], NULL_BLOCK, "write to null block"))
            rows = self.pattern(hashes[written.start:written.stop], layer)
            self._write(layer, blocks, offsets, rows)
            if not layer.state:
                digests.append((layer, lo, self.digest(torch.cat([read, rows]))))
        return self._sample(tokens, known, start, end, hashes, digests)

    def check(self, req_id: str, layer: LayerKV, table: Sequence[int], positions: range, hashes: torch.Tensor,
               wrong: list[WrongKV]) -> torch.Tensor:
        """Read ``positions`` of ``layer``; record every one that differs from recomputing or sits in the null
        block."""
        if not positions:
            return torch.empty((0, layer.width(self.block_size)), dtype=torch.int8)
        blocks, offsets = self._slots(layer, table, positions)
        read = self._read(layer, blocks, offsets)
        differs = (read != self.pattern(hashes[positions.start:positions.stop], layer)).any(dim=1)
        for i in (differs | (blocks == NULL_BLOCK)).nonzero().flatten().tolist():
            reason = "null block" if int(blocks[i]) == NULL_BLOCK else "differs"
            wrong.append(WrongKV(req_id, layer.name, positions[i], int(blocks[i]), reason))
        return read

    def _sample(self, tokens: Sequence[int], known: int, start: int, end: int, hashes: torch.Tensor,
                digests: list[tuple[LayerKV, int, torch.Tensor]]) -> list[int]:
        if end < known:
            return []  # a prefill chunk samples nothing
        sums = [(layer, lo, torch.cat([torch.zeros(1, dtype=torch.int64), d.cumsum(0)])) for layer, lo, d in digests]
        out: list[int] = []
        for p in range(max(start, known - 1), end):
            total = 0
            for layer, lo, cum in sums:
                first = lo if layer.window is None else max(lo, p - layer.window + 1)
                total += int(cum[p + 1 - lo] - cum[first - lo])
            out.append(mix(int(hashes[p]), total & _M64) % VOCAB)
            if p + 1 >= end or tokens[p + 1] != out[-1]:
                break  # sampling disagrees with the next draft token: it and the drafts after it are rejected
        return out

    # -- what the outputs must be -----------------------------------------------------------------------------

    def reference(self, prompt: Sequence[int], count: int) -> list[int]:
        """The ``count`` tokens greedy decoding continues ``prompt`` with when every byte read is right."""
        tokens, hashes = list(prompt), prefix_hashes(prompt)
        attention = [layer for layer in self.layers if not layer.state]
        digests = [self.digest(self.pattern(torch.tensor(hashes), layer)) for layer in attention]
        for _ in range(count):
            known = len(tokens)
            tokens += self._sample(tokens, known, known - 1, known, torch.tensor(hashes),
                                   [(layer, 0, d) for layer, d in zip(attention, digests, strict=True)])
            hashes.append(mix(hashes[-1], tokens[-1] + 2))
            newest = torch.tensor(hashes[-1:])
            digests = [torch.cat([d, self.digest(self.pattern(newest, layer))])
                       for layer, d in zip(attention, digests, strict=True)]
        return tokens[len(prompt):]


# ---- the engine: scheduler, worker connector, stand-in model -------------------------------------------------


@dataclass
class RequestRecord:
    """What the engine's client saw of a request."""

    prompt: list[int]
    max_tokens: int
    output: list[int] = field(default_factory=list)
    finish_reason: Any = None
    external_cached_tokens: int | None = None
    """vLLM's ``prefill_stats.num_external_cached_tokens`` of its first scheduling (kvoffload's hit)."""
    local_cached_tokens: int | None = None


class Engine:
    """vLLM's scheduler and kvoffload's two connector roles, stepped as ``EngineCore.step`` steps them."""

    def __init__(self, config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        self.config = config
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(config.cache_config.block_size, hash_fn)
        self.scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(config),
                                   block_size=config.cache_config.block_size, log_stats=True)
        self.worker = KVOffloadConnector(config, KVConnectorRole.WORKER, kv_cache_config)
        kv_caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"),
                                      config.cache_config.get_resolved_kv_cache_layout())
        self.worker.register_kv_caches(kv_caches)
        self.model = StandInModel(kv_cache_config, kv_caches)
        self.tables: dict[str, list[list[int]]] = {}
        self.records: dict[str, RequestRecord] = {}
        self.wrong: list[WrongKV] = []
        self.stats = KVOffloadStats()
        self.external_hits = 0
        """vLLM's count of tokens loaded through the connector (``connector_prefix_cache_stats``), resumed
        requests included."""
        self.preempted: set[str] = set()
        """Every request vLLM preempted (``preempted_req_ids`` of any step)."""
        self.drafts = [0, 0]
        """Draft tokens verified and accepted (vLLM's ``spec_decoding_stats``)."""
        self.drafter: Any = None
        """With speculative decoding: ``(engine, req_id) -> draft tokens``, run after each step."""

    # -- the client side --------------------------------------------------------------------------------------

    def add_request(self, req_id: str, prompt: Sequence[int], max_tokens: int,
                    cache_salt: str | None = None) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        request = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=params,
                          pooling_params=None, block_hasher=self.block_hasher, cache_salt=cache_salt)
        self.records[req_id] = RequestRecord(list(prompt), max_tokens)
        self.scheduler.add_request(request)
        return request

    def abort(self, *req_ids: str) -> None:
        self.scheduler.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)

    def reset_prefix_cache(self, preempt_running: bool = False) -> None:
        """Empty vLLM's device prefix cache; ``preempt_running``: first preempt every running request (vLLM's own
        preemption path for a reset, as ``LLM.reset_prefix_cache(reset_running_requests=True)``)."""
        if not self.scheduler.reset_prefix_cache(reset_running_requests=preempt_running):
            raise RuntimeError("vLLM did not reset its prefix cache: a request still holds blocks")

    def run(self, max_steps: int = 10_000) -> None:
        """Step until the scheduler has nothing left (``EngineCore``'s loop)."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"not idle after {max_steps} steps")

    def run_steps(self, count: int) -> None:
        """Exactly ``count`` engine steps, whether or not anything is scheduled (an engine steps with nothing
        scheduled while loads are in flight)."""
        for _ in range(count):
            self.step()

    def kv_differences(self, req_id: str, positions: range) -> list[WrongKV]:
        """Positions of a running request whose device KV differs from what recomputing its known tokens writes
        (a rejected draft token's KV, until a later step recomputes the position)."""
        known = list(self.scheduler.requests[req_id].all_token_ids)
        hashes = torch.tensor(prefix_hashes(known[:positions.stop]), dtype=torch.int64)
        found: list[WrongKV] = []
        for layer in self.model.layers:
            if not layer.state:
                self.model.check(req_id, layer, self.tables[req_id][layer.group], positions, hashes, found)
        return found

    def expected(self, req_id: str) -> list[int]:
        record = self.records[req_id]
        return self.model.reference(record.prompt, record.max_tokens)

    # -- one engine step ---------------------------------------------------------------------------------------

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self.preempted.update(out.preempted_req_ids or ())
        runner_output = self.run_worker_step(out)
        for client_outputs in self.scheduler.update_from_output(out, runner_output).values():
            self._collect(client_outputs)
        if self.drafter is not None:  # the model runner's drafter proposes for the requests that sampled
            sampled = [r for r, t in zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True)
                       if t and r in self.scheduler.requests and not self.scheduler.requests[r].is_finished()]
            self.scheduler.update_draft_token_ids(DraftTokenIds(sampled, [self.drafter(self, r) for r in sampled]))
        return out

    def run_worker_step(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """The worker side of one step, in the order of vLLM's model runners: 0.32's V1 ``execute_model`` and
        ``KVConnectorModelRunnerMixin._get_kv_connector_output``, and ``gpu/kv_connector.ActiveKVConnector`` of
        Model Runner V2 (0.32 to 0.34, the only runner 0.34 has), which also calls ``finish_forward``."""
        worker, meta = self.worker, out.kv_connector_metadata
        assert meta is not None
        worker.handle_preemptions(meta)
        self.update_tables(out)  # the runner's _update_states: requests, block tables, zeroed and copied blocks
        with set_forward_context(None, self.config):
            worker.bind_connector_metadata(meta)
            if out.has_sync_kv_loads:
                worker.start_load_kv(get_forward_context())
            req_ids, sampled = self.forward(out) if out.total_num_scheduled_tokens else ([], [])
            worker.finish_forward()
            if not out.has_sync_kv_loads:
                worker.start_load_kv(get_forward_context())
            worker.wait_for_save()
            results = worker.get_transfer_results(out.finished_req_ids)
            kv_output = KVConnectorOutput(
                finished_sending=results.finished_sending, finished_recving=results.finished_recving,
                failed_recving=results.failed_recving, invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_stats=worker.get_kv_connector_stats(),
                kv_cache_events=worker.get_kv_connector_kv_cache_events(),
                kv_connector_worker_meta=worker.build_connector_worker_meta())
            worker.clear_connector_metadata()
        return model_runner_output(req_ids, sampled, kv_output)

    def update_tables(self, out: SchedulerOutput) -> None:
        for req_id in itertools.chain(out.finished_req_ids, out.preempted_req_ids or ()):
            self.tables.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = out.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if req_id not in self.tables:  # resumed: vLLM sends its whole table
                self.tables[req_id] = [list(ids) for ids in (new_ids or ())]
            elif new_ids is not None:
                for table, ids in zip(self.tables[req_id], new_ids, strict=True):
                    table.extend(ids)
        if out.new_block_ids_to_zero:  # vLLM zeroes a state model's new blocks before anything reads them
            for layer in self.model.layers:
                layer.pages[torch.tensor(out.new_block_ids_to_zero)] = 0
        if out.kv_cache_block_copies:
            raise NotImplementedError("the stand-in model runner does not copy KV blocks (kv_cache_block_copies)")

    def forward(self, out: SchedulerOutput) -> tuple[list[str], list[list[int]]]:
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        req_ids, sampled = [], []
        for req_id, count in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            known = list(request.all_token_ids)
            tokens = known + list(out.scheduled_spec_decode_tokens.get(req_id, ()))
            req_ids.append(req_id)
            sampled.append(self.model.run(req_id, tokens, len(known), starts[req_id], count, self.tables[req_id],
                                          self.wrong))
        return req_ids, sampled

    def _collect(self, outputs: Any) -> None:
        for o in outputs.outputs:
            record = self.records[o.request_id]
            record.output.extend(o.new_token_ids)
            if o.finish_reason is not None:
                record.finish_reason = o.finish_reason
            if o.prefill_stats is not None and record.external_cached_tokens is None:
                record.external_cached_tokens = o.prefill_stats.num_external_cached_tokens
                record.local_cached_tokens = o.prefill_stats.num_local_cached_tokens
        stats = outputs.scheduler_stats
        if stats is None:
            return
        if stats.kv_connector_stats:
            self.stats = self.stats.aggregate(KVOffloadStats(data=dict(stats.kv_connector_stats)))
        if stats.spec_decoding_stats is not None:
            self.drafts[0] += stats.spec_decoding_stats.num_draft_tokens
            self.drafts[1] += stats.spec_decoding_stats.num_accepted_tokens
        if stats.connector_prefix_cache_stats is not None:
            self.external_hits += stats.connector_prefix_cache_stats.hits
            self.external_hits += stats.connector_prefix_cache_stats.preempted_hits

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


# ---- for the tests -------------------------------------------------------------------------------------------


class Engines:
    """Builds a test's engines (``make_engine`` over one model directory) and shuts them all down (``close``)."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.made: list[Engine] = []

    def __call__(self, specs: Mapping[str, KVCacheSpec] | None = None, **config: Any) -> Engine:
        self.made.append(make_engine(self.model, specs or full_attention(2), **config))
        return self.made[-1]

    def close(self) -> None:
        for engine in self.made:
            engine.shutdown()


def tokens(seed: int, count: int) -> list[int]:
    """``count`` deterministic token ids; different seeds share no prefix."""
    return [mix(seed, i) % VOCAB for i in range(count)]


def assert_served_right(engine: Engine, *req_ids: str) -> None:
    """Every byte read back was what recomputing writes, and each request finished with the reference output."""
    assert engine.wrong == []
    for req_id in req_ids:
        record = engine.records[req_id]
        assert record.finish_reason is not None, req_id
        assert record.output == engine.expected(req_id), req_id


def store_then_reset(engine: Engine, prompts: Mapping[str, Sequence[int]], max_tokens: int = 6) -> None:
    """Serve ``prompts`` (kvoffload stores their blocks), then empty vLLM's device prefix cache."""
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, prompt, max_tokens)
    engine.run()
    engine.reset_prefix_cache()
