"""Everything one emulated instance holds: engine model, runtime, P/D books, metrics, events."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import aiohttp

from config.settings import Role
from replay.emulator.config import EmulatorConfig
from replay.emulator.kv_publisher import KVEventPublisher
from replay.emulator.metrics import EmulatorMetrics, EngineLoad
from replay.emulator.pd import BootstrapRooms, PinnedStore, TransferModel
from replay.emulator.responses_shapes import StoredResponses
from replay.emulator.runtime import EngineRuntime
from replay.emulator.vllm_hashing import BlockNamespace
from replay.engine.engine import Engine
from replay.engine.network import Network
from replay.engine.prefix_cache import PrefixCache
from replay.engine.timing import StepTiming
from routing.hashing import BlockHasher
from routing.prompt_encoder import ApproxPromptEncoder, PromptEncoder
from routing.tokenizer import ApproxTokenizer
from routing.types import AllBlocksCleared


@dataclass(eq=False, slots=True)
class EmulatorState:
    config: EmulatorConfig
    engine: Engine
    runtime: EngineRuntime
    metrics: EmulatorMetrics
    prompt_encoder: PromptEncoder  # the gateway's, for the same model directory
    hasher: BlockHasher
    pinned: PinnedStore
    rooms: BootstrapRooms
    transfers: TransferModel
    publisher: KVEventPublisher | None = None
    session: aiohttp.ClientSession | None = None  # outbound: KV pulls and bootstrap polls
    port: int = 0
    responses: StoredResponses = field(default_factory=StoredResponses)  # /v1/responses made
    # LoRA adapters served (vLLM's --lora-modules), by name; the adapter of each request that
    # has produced output, and per adapter its requests, in the order vLLM's LoRARequestStates
    # keeps them: vLLM learns of a request's QUEUED and SCHEDULED events with its first output,
    # so an adapter is listed from then until its last request leaves; one waiting for a slot
    # is not listed (it counts under waiting_by_reason "deferred").
    adapters: dict[str, BlockNamespace] = field(default_factory=dict)
    adapter_of: dict[str, str] = field(default_factory=dict)
    adapter_requests: dict[str, int] = field(default_factory=dict)
    _next_block_id: int = 0

    @property
    def max_model_len(self) -> int:
        return self.engine.kv_capacity_tokens

    def block_ids(self, tokens: int) -> list[int]:
        """Fresh 'physical' block ids for a pinned prompt (what NIXL's remote_block_ids are)."""
        n = -(-tokens // self.config.block_size)
        start = self._next_block_id
        self._next_block_id += n
        return list(range(start, start + n))

    def adapter_entered(self, request_id: str, adapter: str) -> None:
        self.adapter_of[request_id] = adapter
        self.adapter_requests[adapter] = self.adapter_requests.get(adapter, 0) + 1

    def adapter_left(self, request_id: str) -> None:
        adapter = self.adapter_of.pop(request_id, None)
        if adapter is None:
            return
        self.adapter_requests[adapter] -= 1
        if self.adapter_requests[adapter] <= 0:
            del self.adapter_requests[adapter]

    def load(self) -> EngineLoad:
        engine = self.engine
        # vLLM counts a request as running once it is scheduled, prefill chunks included.
        started = [j for j in engine.queue if j.started_s is not None]
        running = len(engine.running) + len(started)
        waiting = len(engine.queue) - len(started) + len(engine.joining)
        used = (
            engine.reserved_tokens
            + sum(j.prompt_tokens for j in started)
            + self.pinned.tokens
            + self.rooms.pinned_tokens
        )
        load = EngineLoad(
            running,
            waiting,
            min(used / engine.kv_capacity_tokens, 1.0),
            deferred=engine.waiting_for_slot(),
        )
        if not self.adapters:
            return load
        return replace(load, adapters_listed=tuple(self.adapter_requests))

    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache (vLLM's /reset_prefix_cache) and tell subscribers."""
        if self.engine.cache is not None:
            self.engine.cache = PrefixCache(self.engine.cache.capacity_blocks)
        if self.publisher is not None:
            self.publisher.publish([AllBlocksCleared()])


def _prompt_encoder(config: EmulatorConfig) -> PromptEncoder:
    if config.model_dir:
        from backends.model_files import load_prompt_encoder

        return load_prompt_encoder(config.model_dir)
    return ApproxPromptEncoder(ApproxTokenizer(config.chars_per_token))


def build_state(config: EmulatorConfig) -> EmulatorState:
    """The instance's model and books; nothing is bound or started yet."""
    config.validate()
    profile = config.engine_profile
    timing = StepTiming.from_profile(profile, config.overhead_ms)
    capacity = config.cache_capacity_tokens or profile.kv_capacity_tokens
    chunk = config.chunk_tokens
    if config.role is not Role.PREFILL:  # same defaults replay.sim.fleet gives the simulator
        chunk = chunk or profile.max_batched_tokens
    tbt = config.decode_tbt_limit_ms / 1e3 if config.decode_tbt_limit_ms is not None else None
    engine = Engine(
        config.engine_id,
        # Always BOTH: which leg a request is comes from the request (kv_transfer_params /
        # bootstrap fields), not from the instance; BOTH makes the engine decode after its
        # own prefill only when a request asks for more than one token (colocated serving).
        Role.BOTH,
        timing,
        cache=PrefixCache(max(capacity // config.block_size, 1)),
        max_batch=config.max_batch or profile.max_batch,
        kv_capacity_tokens=profile.kv_capacity_tokens,
        chunk_tokens=chunk,
        decode_tbt_limit_s=tbt,
        max_segment_steps=1,  # one event per step: tokens stream as they are made
        max_adapters=config.max_loras if config.lora_adapters else None,
        adapter_load_s=config.lora_load_s,
        max_cached_adapters=config.max_cpu_loras,
    )
    runtime = EngineRuntime(
        engine, config.time_scale, config.block_size, max_inflight=config.max_inflight
    )
    network = Network(config.link_bytes_per_s, config.link_latency_s)
    adapters = {
        name: BlockNamespace(lora_name=name, lora_path=path, lora_id=i)
        for i, (name, path) in enumerate(config.lora_adapters, start=1)
    }
    return EmulatorState(
        adapters=adapters,
        config=config,
        engine=engine,
        runtime=runtime,
        metrics=EmulatorMetrics(
            config.served_model,
            sglang=config.protocol.value == "sglang",
            block_size=config.block_size,
            num_gpu_blocks=profile.kv_capacity_tokens // config.block_size,
            max_loras=config.max_loras if adapters else None,
        ),
        prompt_encoder=_prompt_encoder(config),
        hasher=BlockHasher(config.block_size, config.hash_seed),
        pinned=PinnedStore(config.pin_timeout_s),
        rooms=BootstrapRooms(config.pin_timeout_s),
        transfers=TransferModel(runtime, network, profile.kv_bytes_per_token),
    )
