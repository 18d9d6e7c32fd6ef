"""``AiotransferConnector``: vLLM's ``KVConnectorBase_V1`` on aiotransfer (this module imports vLLM).

A thin adapter: the scheduler role delegates to :class:`SchedulerSide`, the worker role to
:class:`WorkerSide`; what crosses from one to the other each step is an :class:`Orders` in the connector
metadata. Push, not pull: the decode's worker tells the prefill's worker where to write
(``send_metadata``), and the prefill writes as soon as it has been told, with no engine step in between.

Hybrid models (Mamba2 + full attention, vLLM's hybrid memory allocator): the connector is ``SupportsHMA``;
the attention group's blocks travel as KV pages, the Mamba group's state block with ``send_state``, and
the prefill stops one prompt token short (:attr:`CacheGroups.backoff`, as vLLM's NixlConnector does).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.request import RequestStatus

from ...errors import ConfigError
from ._config import CacheGroups, ConnectorConfig
from ._scheduler import Orders, SchedulerSide
from ._worker import WorkerSide

__all__ = ["AiotransferConnector", "AiotransferHandshake", "AiotransferMetadata"]

_COMPLETED = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def _log_through_vllm() -> None:
    """Under vLLM only the ``vllm`` logger has a handler, so aiotransfer's INFO lines would vanish and its
    warnings print bare. Route them through vLLM's handlers and level, unless the application configured
    logging for aiotransfer or the root logger itself."""
    ours, theirs = logging.getLogger("aiotransfer"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())


class AiotransferMetadata(KVConnectorMetadata):
    """One scheduler step's orders for the workers."""

    def __init__(self, orders: Orders) -> None:
        self.orders = orders


@dataclass
class AiotransferHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler at start: the control address decode must reach it at."""

    endpoint: str


def cache_groups(kv_cache_config: Any) -> CacheGroups:
    """Which of vLLM's KV cache groups hold attention KV and Mamba state; raises :class:`ConfigError` for
    layouts the connector cannot move (sliding-window or other groups, several attention or Mamba groups)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) == 1 and isinstance(groups[0].kv_cache_spec, MambaSpec):
        raise ConfigError("AiotransferConnector moves Mamba state only next to attention KV (hybrid models); "
                          "this model has Mamba layers only")
    if len(groups) <= 1:
        return CacheGroups()  # one group, as without the hybrid allocator: its blocks move as they are
    attention = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)]
    mamba = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)]
    others = sorted({type(g.kv_cache_spec).__name__ for i, g in enumerate(groups) if i not in attention + mamba})
    if others or len(attention) != 1 or len(mamba) > 1:
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise ConfigError(
            f"AiotransferConnector moves one full-attention KV cache group plus at most one Mamba group; this "
            f"model has {kinds}. For sliding-window or chunked-attention models, start vLLM with "
            "disable_hybrid_kv_cache_manager=True (--disable-hybrid-kv-cache-manager): every layer's KV is then "
            "kept like full attention, which the connector moves")
    spec_blocks = int(getattr(groups[mamba[0]].kv_cache_spec, "num_speculative_blocks", 0) or 0) if mamba else 0
    return CacheGroups(attention=attention[0], mamba=mamba[0] if mamba else None, mamba_spec_blocks=spec_blocks)


def _attention_block_size(kv_cache_config: Any, groups: CacheGroups, default: int) -> int:
    """Tokens per block of the attention KV the connector moves: on hybrid models vLLM sizes it to hold a
    Mamba state page, which ``cache_config.block_size`` (``default``) need not say."""
    found = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(found) > groups.attention:
        return int(getattr(found[groups.attention].kv_cache_spec, "block_size", default) or default)
    return default


class AiotransferConnector(KVConnectorBase_V1, SupportsHMA):
    """KV connector moving a request's KV from a prefill to a decode vLLM instance with aiotransfer.

    ``KVTransferConfig(kv_connector="AiotransferConnector",
    kv_connector_module_path="aiotransfer.integrations.vllm", kv_role="kv_producer" | "kv_consumer" |
    "kv_both", kv_connector_extra_config={"engine": "mooncake_tcp" | "nixl", ...})``; the extra config is
    :class:`~aiotransfer.integrations.vllm.ConnectorConfig`.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        self._config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ConfigError("AiotransferConnector supports tensor_parallel_size=1 and pipeline_parallel_size=1 "
                              f"for now (got TP {parallel.tensor_parallel_size}, "
                              f"PP {parallel.pipeline_parallel_size})")
        self._block_size = int(vllm_config.cache_config.block_size)
        self._groups = cache_groups(kv_cache_config)
        self._kv_cache_config = kv_cache_config
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self._config, self._block_ids_of, self._groups,
                                            _attention_block_size(kv_cache_config, self._groups, self._block_size))
        else:
            self._worker = WorkerSide(self._config)

    @property
    def scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "scheduler-side call on a worker connector"
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        assert self._worker is not None, "worker-side call on a scheduler connector"
        return self._worker

    # -- worker side -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self._groups.mamba is None:
            self.worker_side.register(kv_caches, self._block_size)
            return
        groups = self._kv_cache_config.kv_cache_groups
        attention = groups[self._groups.attention].layer_names
        mamba = groups[self._groups.mamba].layer_names
        self.worker_side.register_hybrid({n: kv_caches[n] for n in attention}, {n: kv_caches[n] for n in mamba},
                                         self._block_size)

    def get_handshake_metadata(self) -> AiotransferHandshake | None:
        endpoint = self.worker_side.endpoint
        return AiotransferHandshake(endpoint) if endpoint is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, AiotransferMetadata)
            self.worker_side.start_receives(meta.orders)
            if self.worker_side.streams_layers:
                self.worker_side.begin_pass(meta.orders)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Before this step's pass may overwrite them: no write may still read a preempted request's blocks.
        assert isinstance(kv_connector_metadata, AiotransferMetadata)
        if kv_connector_metadata.orders.preempted:
            self.worker_side.handle_preemptions(kv_connector_metadata.orders)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: a request runs only once its whole KV has landed

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # Layer streaming: a room whose decode has asked, in a pass long enough to stream (StreamRule), pushes
        # this layer's blocks now, on the connector's loop thread; this thread only tells it (one loop wake-up,
        # in steps with such a room; none in the others).
        self.worker_side.layer_written(layer_name)

    def wait_for_save(self) -> None:
        # Nothing to wait for: vLLM keeps a sending request's blocks until get_finished reports it released.
        if self.worker_side.streams_layers:
            self.worker_side.end_pass()
        elif self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, AiotransferMetadata)
            self.worker_side.start_sends(meta.orders)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, received = self.worker_side.finished(finished_req_ids)
        return sent or None, received or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # A failed load is also finished: hybrid models' vLLM takes the failure per request (failed_recving).
        sent, received = self.worker_side.finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=received,
                                          failed_recving=self.worker_side.take_failed_receives(received))

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- scheduler side --------------------------------------------------------------------------
    def _block_ids_of(self, req_id: str) -> tuple[list[int], ...]:
        assert self._kv_cache_manager is not None, "the scheduler did not bind its KV cache manager"
        return tuple(self._kv_cache_manager.get_block_ids(req_id))

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.scheduler_side.set_endpoints(
            {rank: meta.endpoint for rank, meta in metadata.items() if isinstance(meta, AiotransferHandshake)})

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Any) -> None:
        # The first scheduler call that sees the request: its kv_transfer_params are checked here, once, and
        # every later call follows that decision (a refused request is computed locally).
        self.scheduler_side.admit(request)
        # A hybrid prefill computes the prompt one token short (CacheGroups.backoff), cut here as vLLM's
        # NixlConnector cuts it (nixl/base_scheduler.py, _truncate_request_for_prefill): the request's token
        # lists and counts are vLLM's own, so they are edited in place, once.
        backoff = 0 if request.get_skip_reading_prefix_cache() else self.scheduler_side.prefill_backoff(request)
        if not backoff:
            return
        if request.prompt_token_ids is not None:
            del request.prompt_token_ids[-backoff:]
        elif request.prompt_embeds is not None:
            request.prompt_embeds = request.prompt_embeds[:-backoff]
        else:
            return
        del request._all_token_ids[-backoff:]
        request.num_prompt_tokens -= backoff
        request.max_tokens = 1

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        groups = blocks.get_unhashed_block_ids_all_groups()
        self.scheduler_side.after_alloc(request, self._groups.pages(groups), num_external_tokens,
                                        self._groups.state_block(groups))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return AiotransferMetadata(self.scheduler_side.build_orders(scheduler_output.num_scheduled_tokens,
                                                                    scheduler_output.preempted_req_ids or ()))

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler_side.on_worker_output(connector_output.finished_sending or (),
                                             connector_output.finished_recving or ())

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        if block_ids and isinstance(block_ids[0], (list, tuple)):
            return self.request_finished_all_groups(request, tuple(block_ids))
        return self.scheduler_side.request_finished(request, list(block_ids), request.status in _COMPLETED)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, dict[str, Any] | None]:
        # Every group's blocks stay pinned or go back together: vLLM applies one delay_free_blocks to all.
        return self.scheduler_side.request_finished(request, self._groups.pages(block_ids),
                                                    request.status in _COMPLETED)

    def has_pending_push_work(self) -> bool:
        return self.scheduler_side.has_pending_work()
