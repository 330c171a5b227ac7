"""``KvpoolConnector``: vLLM's KV connector (``KVConnectorBase_V1``) for a kvpool pool.

vLLM runs one instance in the scheduler and one per worker; they talk only through the
metadata the scheduler builds each step.

Scheduler side
  ``get_num_new_matched_tokens`` asks the pool how many leading prompt blocks it holds
  (LOOKUP: no side effects; bounded by ``lookup_timeout_s``; any failure answers 0 and
  silences the pool for ``backoff_s``, so a dead pool never stalls the scheduler).
  ``update_state_after_alloc`` pins what it will load (LEASE, one per parallel rank);
  ``build_connector_meta`` tells the workers which pool blocks go into which vLLM blocks, and
  which vLLM blocks became full this step and go to the pool.

Worker side (layer by layer; ``layerwise.py``)
  ``start_load_kv`` starts a thread that reads the leased blocks (GET) in a few layer ranges
  (``load_layer_chunks``), in layer order, into host buffers, and returns; vLLM calls
  ``wait_for_layer_load`` inside each attention layer before it reads that layer's pages
  (``maybe_transfer_kv_layer`` wraps vLLM's attention op, the CPU backend's included), which
  waits for the layer's range and copies its blocks into vLLM's pages in the engine's
  own thread. A block that could not be read (the lease came back short because it was
  evicted meanwhile, a range failed or came too late, the agent died) is reported by
  ``get_block_ids_with_load_errors`` and vLLM recomputes it (``kv_load_failure_policy`` must
  be ``recompute``: the connector refuses to start otherwise). If the layer hooks never ran
  during a step with loads, those loads fail and later loads complete in ``start_load_kv``,
  before the forward pass. ``save_kv_layer`` copies the layer's blocks that became full this
  step out of vLLM's pages right after the layer's attention wrote them; ``wait_for_save``
  copies any layer the hooks missed, waits for device copies, and hands the blocks to a
  sender thread that PUTs them (every layer in one request; ``saves.py``: it waits up to
  ``save_coalesce_ms`` for more saves to send with them). No page is read after
  ``wait_for_save`` returns: vLLM may free or reuse its blocks at once (``request_finished``
  never delays a free), and the earliest write to a reused block is in a later step.

A request can turn the pool off for itself with ``kv_transfer_params: {"kvpool": {"load":
false, "save": false}}`` (either or both; a prompt that must not be stored, a one-off): with
neither, the connector does not even look it up. It can never turn on what the engine's
settings turned off, and a malformed ``kvpool`` entry turns both off for that request
(counted in ``request_params_invalid``, logged).

Keys are vLLM's own block hashes (``bytes(block_hash)``: they fold in the cache salt, LoRA
and multimodal inputs), in the namespace (model, parallel rank, KV cache group). vLLM's
``NONE_HASH`` is random per process unless ``PYTHONHASHSEED`` is set: every instance sharing
a pool must set the same value, or none of them ever hits the others' blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvpool_agent.connectors.saves import Save, SaveQueue, StepBuffers
from kvpool_agent.connectors.settings import (
    ConnectorConfigError,
    ConnectorSettings,
    Discovery,
    RequestParams,
)
from kvpool_agent.connectors.stats import ConnectorStats
from kvpool_agent.connectors.vllm.layerwise import (
    LayerLoad,
    LayerSave,
    LoadItem,
    SavePart,
    scatter_layer,
)
from kvpool_agent.connectors.vllm.layout import BlockLayout
from kvpool_agent.dataplane.client import (
    Geometry,
    KVClient,
    Lease,
    TransferClient,
    TransferConnectionError,
    TransferError,
)
from kvpool_agent.dataplane.cuda_ipc import NotOnCuda
from kvpool_agent.dataplane.keys import KeyNamespace
from kvpool_agent.dataplane.routed import RoutedClient, ring_member
from kvpool_agent.dataplane.shm import ShmClient

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvpool.connector.vllm")

SHM_OPEN_ERRORS = (
    TransferError,
    TransferConnectionError,
    OSError,
    NotOnCuda,  # a CUDA agent's GPU this process does not see (or no CUDA here)
    RuntimeError,  # CUDA refused to open the agent's IPC handle
)
"""What opening a same-node agent's socket and arena may fail with (the pool goes on)."""


def _through_socket(client: KVClient, replica: str) -> bool:
    """Whether ``replica`` (of a lease or a PUT's result) was reached through a same-node
    agent's socket rather than the transfer port."""
    if isinstance(client, RoutedClient):
        return replica == client.shm.path
    return isinstance(client, ShmClient)


FLUSH_TIMEOUT_S = 30.0
"""How long ``shutdown`` waits for queued saves."""


@dataclass
class LoadSpec:
    """Pool blocks ``first ..`` of a chain go into vLLM blocks ``block_ids`` (in order)."""

    req_id: str
    first: int
    block_ids: list[int]
    leases: dict[int, Lease | None]
    """Per parallel rank (None: the lease failed; every block fails to load)."""


@dataclass
class SaveSpec:
    """vLLM blocks ``block_ids`` hold chain blocks ``first ..`` of ``keys``."""

    req_id: str
    keys: list[bytes]
    first: int
    block_ids: list[int]


@dataclass
class KvpoolConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _Tracked:
    """What the scheduler side keeps of a running request."""

    request: Request
    pool_blocks: int
    """Leading prompt blocks the pool held at lookup (saves start there)."""
    local_tokens: int
    """Tokens vLLM's own prefix cache had (block-aligned)."""
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0
    """Chain blocks the pool holds or that were sent to it."""
    save: bool = True
    """Whether the request's blocks may go to the pool (its ``kv_transfer_params``)."""


class KvpoolConnector(KVConnectorBase_V1):
    """vLLM's KV connector for a kvpool pool (see the module docstring)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = ConnectorSettings.parse(transfer.kv_connector_extra_config)
        if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            raise ConnectorConfigError(
                "kv_transfer_config.kv_load_failure_policy must be 'recompute' for the "
                "kvpool connector: a block the pool fails to deliver is recomputed, never "
                "turned into a failed request"
            )
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise ConnectorConfigError(
                f"the kvpool connector supports one KV cache group; this model has "
                f"{len(groups)} (hybrid attention is not supported yet)"
            )
        self.block_size = int(vllm_config.cache_config.block_size)
        model = vllm_config.model_config
        served = model.served_model_name
        if isinstance(served, list):
            served = served[0] if served else None
        self.model_id = self.settings.model or str(served or model.model)
        parallel = vllm_config.parallel_config
        self.world = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
        self.stats = ConnectorStats()
        self._token = self.settings.token()
        self._discovery = Discovery(self.settings)
        self._client: KVClient | None = None
        self._device_saves = 0
        """Queued saves whose buffer is in GPU memory (``_save_on_device``)."""
        self._local: ShmClient | None = None
        """Beside `pool`/`replicas`: the pool's agent on this node, through ``unix_socket``."""
        self._routed: RoutedClient | None = None
        self._local_retry_at = 0.0
        self._saver: tuple[KVClient, ShmClient, KVClient] | None = None
        """On the same node: the saves' client, its own connection (a sibling), and the
        client whose mapping that shares."""
        self._scheduler = role == KVConnectorRole.SCHEDULER
        self._client_replicas: list[str] = []
        self._client_lock = threading.Lock()
        self._silent_until = 0.0
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: list[LoadSpec] = []
        # worker side
        self._rank = 0
        self._views: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._layout: BlockLayout | None = None
        self._checked_geometry = False
        self._load_errors: set[int] = set()
        self._layerwise_loads = self.settings.layerwise
        """False once a step with loads ran without vLLM's layer hooks: loads then complete
        in ``start_load_kv``."""
        self._loading: LayerLoad | None = None
        self._saving: LayerSave | None = None
        self._hooks_ran = False
        """A layer hook ran since this step's metadata was bound (the forward pass began)."""
        self._buffers = StepBuffers()
        """The steps' save buffers on a CPU engine, reused."""
        self._saves = SaveQueue(
            self._send_save,
            max_pending=self.settings.max_pending_saves,
            coalesce_s=self.settings.save_coalesce_ms / 1e3,
        )
        log.info(
            "kvpool connector (%s): model %r, block size %d, %s",
            role.name.lower(),
            self.model_id,
            self.block_size,
            (
                f"pool {self.settings.pool}.{self.settings.namespace}"
                if self.settings.pool
                else f"replicas {self.settings.replicas}"
                if self.settings.replicas
                else "no pool"
            )
            + (
                f", same-node agent {self.settings.unix_socket}"
                if self.settings.unix_socket
                else ""
            ),
        )

    # ------------------------------------------------------------------ shared

    def _ns(self, rank: int) -> KeyNamespace:
        return KeyNamespace(self.model_id, rank=rank, layer_group=0)

    def _transfer(self, timeout: float) -> KVClient | None:
        """A client over the replicas discovery finds now (None: none found), with the pool's
        agent on this node behind ``unix_socket`` when one is set beside them; or of the
        same-node agent alone (``unix_socket`` only)."""
        path = self.settings.unix_socket
        if path is not None and self.settings.pool is None and self.settings.replicas is None:
            return self._same_node(path, timeout)
        replicas = self._discovery.replicas()
        with self._client_lock:
            if replicas != self._client_replicas or self._client is None:
                if self._client is not None:
                    self._client.close()
                self._client = None
                self._routed = None
                self._client_replicas = list(replicas)
                if replicas:
                    self._client = TransferClient(
                        replicas,
                        token=self._token,
                        timeout=timeout,
                        connect_timeout=min(timeout, 1.0),
                        retries=0,
                        checksums=self.settings.checksums,
                    )
            tcp = self._client
        if path is None or not isinstance(tcp, TransferClient):
            return tcp
        return self._with_local(tcp, path, timeout)

    def _with_local(self, tcp: TransferClient, path: str, timeout: float) -> KVClient:
        """``tcp``, with the chains of the pool's agent on this node through its socket
        (``RoutedClient``); ``tcp`` alone while that agent cannot be reached (tried again
        after ``backoff_s``) or is not in the ring."""
        with self._client_lock:
            local = self._local
            if local is not None and local.broken:
                local.close()
                local = self._local = self._routed = None
            if local is None:
                if time.monotonic() < self._local_retry_at:
                    return tcp
                try:
                    local = self._open_shm(path, timeout)
                except SHM_OPEN_ERRORS as err:
                    self._local_retry_at = time.monotonic() + self.settings.backoff_s
                    log.info("kvpool: no pool agent on this node at %s (%s)", path, err)
                    return tcp
                self._local = local
            member = ring_member(tcp.replicas, local.pod)
            if member is None:
                return tcp  # the agent behind the socket is not one of this pool's
            if self._routed is None or self._routed.tcp is not tcp or self._routed.shm is not local:
                self._routed = RoutedClient(tcp, local, member)
            return self._routed

    def _same_node(self, path: str, timeout: float) -> KVClient | None:
        """The client of the agent behind ``path``, opened again when its connection broke
        (None while the agent cannot be reached: tried again after ``backoff_s``). The
        scheduler asks only lookups and leases: it does not map the arena."""
        with self._client_lock:
            if isinstance(self._client, ShmClient) and self._client.broken:
                self._client = None
            if self._client is None:
                if self._silenced():
                    return None
                try:
                    self._client = self._open_shm(path, timeout)
                except SHM_OPEN_ERRORS as err:
                    self._failed(f"connecting to the same-node agent {path}", err)
                    return None
            return self._client

    def _open_shm(self, path: str, timeout: float) -> ShmClient:
        """A same-node agent's client; the scheduler asks only lookups and leases, so it
        does not map the arena, but maps its first-block table (misses without a round
        trip)."""
        return ShmClient(
            path,
            token=self._token,
            timeout=timeout,
            connect_timeout=min(timeout, 1.0),
            map_arena=not self._scheduler,
            map_index=self._scheduler,
        )

    def _save_client(self, timeout: float) -> KVClient | None:
        """The saves' client. Through a same-node agent (alone, or the pool's agent on this
        node), a connection of their own beside the loads' (``ShmClient.sibling``, sharing
        its mapping), so a save's PUT never waits behind a load's reads nor the other way
        round; the shared client where that fails, and over the transfer port (whose client
        pools connections)."""
        main = self._transfer(timeout)
        shm = main.shm if isinstance(main, RoutedClient) else main
        if not isinstance(shm, ShmClient) or main is None:
            return main
        with self._client_lock:
            if self._saver is not None:
                ours, sibling, parent = self._saver
                if parent is main and not sibling.broken:
                    return ours
                sibling.close()
                self._saver = None
            try:
                sibling = shm.sibling()
            except (TransferError, TransferConnectionError, OSError) as err:
                log.warning("kvpool: saves share the loads' connection (%s)", err)
                return main
            saver: KVClient = (
                RoutedClient(main.tcp, sibling, main.local)
                if isinstance(main, RoutedClient)
                else sibling
            )
            self._saver = (saver, sibling, main)
            return saver

    def _silenced(self) -> bool:
        return time.monotonic() < self._silent_until

    def _failed(self, what: str, err: Exception) -> None:
        self._silent_until = time.monotonic() + self.settings.backoff_s
        log.warning(
            "kvpool %s failed (%s); answering 0 hits for %.1fs", what, err, self.settings.backoff_s
        )

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        bs = self.block_size
        prompt = int(request.num_prompt_tokens)
        load, save = self._allowed(request)
        # vLLM computes at least the prompt's last token itself.
        chain = [bytes(h) for h in request.block_hashes[: max(0, prompt - 1) // bs]]
        wanted = chain and (load or save)
        started = time.perf_counter()
        pool_blocks = self._lookup(chain) if wanted else 0
        self.stats.add(lookup_s=time.perf_counter() - started)
        self._tracked[request.request_id] = _Tracked(
            request, pool_blocks, num_computed_tokens, saved=pool_blocks, save=save
        )
        if not load:
            return 0, False
        extra = pool_blocks * bs - num_computed_tokens
        if extra <= 0:
            return 0, False
        self.stats.add(hit_blocks=extra // bs)
        return extra, False

    def _allowed(self, request: Request) -> tuple[bool, bool]:
        """Whether the pool may load and save for ``request``: the engine's settings,
        narrowed by the request's ``kv_transfer_params["kvpool"]``. A malformed one fails
        closed (neither), so that a mistyped opt-out never stores a prompt."""
        first = request.request_id not in self._tracked  # vLLM may ask again next step
        try:
            params = RequestParams.of(getattr(request, "kv_transfer_params", None))
        except ValueError as err:
            if first:
                self.stats.add(request_params_invalid=1)
                log.warning(
                    "kvpool: request %s: %s; the pool neither loads nor saves it",
                    request.request_id,
                    err,
                )
            return False, False
        load = self.settings.load and params.load
        save = self.settings.save and params.save
        if first:
            self.stats.add(
                requests_without_load=int(self.settings.load and not params.load),
                requests_without_save=int(self.settings.save and not params.save),
            )
        return load, save

    def _lookup(self, chain: list[bytes]) -> int:
        """Leading blocks of ``chain`` the pool holds for every rank (0 on any failure)."""
        if self._silenced():
            self.stats.add(lookups_skipped=1)
            return 0
        client = self._transfer(self.settings.lookup_timeout_s)
        if client is None:
            self.stats.add(lookups_skipped=1)
            return 0
        self.stats.add(lookups=1)
        shm = client.shm if isinstance(client, RoutedClient) else client
        local = shm.local_misses if isinstance(shm, ShmClient) else 0
        try:
            held = min(len(client.lookup(self._ns(r), chain)) for r in range(self.world))
        except (TransferError, TransferConnectionError, OSError) as err:
            self.stats.add(lookup_errors=1)
            self._failed("lookup", err)
            return 0
        if isinstance(shm, ShmClient) and shm.local_misses - local == self.world:
            self.stats.add(lookups_local=1)
        return held

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return
        tracked.block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens <= 0:
            return
        bs = self.block_size
        first = tracked.local_tokens // bs
        end = (tracked.local_tokens + num_external_tokens) // bs
        chain = [bytes(h) for h in request.block_hashes[:end]]
        leases: dict[int, Lease | None] = {}
        started = time.perf_counter()
        client = self._transfer(self.settings.lookup_timeout_s)
        for rank in range(self.world):
            lease = None
            if client is not None:
                try:
                    lease = client.lease(self._ns(rank), chain, ttl_s=self.settings.lease_ttl_s)
                    near = lease is not None and _through_socket(client, lease.replica)
                    self.stats.add(leases=1, node_leases=int(near))
                except (TransferError, TransferConnectionError, OSError) as err:
                    self.stats.add(lease_errors=1)
                    self._failed("lease", err)
            held = lease.count if lease is not None else 0
            if held < end:
                self.stats.add(lease_short_blocks=end - max(held, first))
            leases[rank] = lease
        self.stats.add(lookup_s=time.perf_counter() - started)
        # Whatever fails to load is recomputed and then saved again from where the pool's
        # copy stopped.
        tracked.saved = min(
            [tracked.saved, *(lease.count if lease else first for lease in leases.values())]
        )
        self._pending_loads.append(
            LoadSpec(request.request_id, first, tracked.block_ids[first:end], leases)
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvpoolConnectorMetadata:
        meta = KvpoolConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if not self.settings.save:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            self._plan_save(meta, tracked, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    tracked.block_ids = list(new_ids[0])
                else:
                    tracked.block_ids.extend(new_ids[0])
            self._plan_save(meta, tracked, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _plan_save(self, meta: KvpoolConnectorMetadata, tracked: _Tracked, tokens: int) -> None:
        """Blocks full once this step ran, not yet in the pool: save them. Prompt blocks, and
        with ``save_decode`` blocks of generated tokens too: only tokens the request already
        holds count (a draft token that may be rejected, or an output not yet appended, never
        does), so every saved block has its hash and its KV was computed by this step."""
        if not tracked.save:
            return
        request = tracked.request
        limit = int(request.num_tokens if self.settings.save_decode else request.num_prompt_tokens)
        full = min(tokens, limit) // self.block_size
        full = min(full, len(request.block_hashes), len(tracked.block_ids))
        if full <= tracked.saved:
            return
        keys = [bytes(h) for h in request.block_hashes[:full]]
        meta.saves.append(
            SaveSpec(
                request.request_id, keys, tracked.saved, tracked.block_ids[tracked.saved : full]
            )
        )
        tracked.saved = full

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks that failed to load are recomputed by vLLM; the worker dropped that step's
        saves of their requests, so saving starts again from the first failed block."""
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid:
            return
        for tracked in self._tracked.values():
            for index, block_id in enumerate(tracked.block_ids[: tracked.saved]):
                if block_id in invalid:
                    tracked.saved = index
                    break

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy their blocks out during the step that filled them: nothing of vLLM's
        # memory is still in flight, so its blocks may be freed now.
        self._tracked.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backend
        from vllm.model_executor.models.utils import extract_layer_index

        self._rank = _worker_rank()
        config = self._vllm_config
        model = config.model_config
        backend = get_current_attn_backend(config).get_name()
        heads = model.get_num_kv_heads(config.parallel_config)
        self._layout = BlockLayout.for_backend(
            backend, self.block_size, heads, model.get_head_size()
        )
        ordered = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        self._views = [self._layout.blocks_view(tensor) for _, tensor in ordered]
        self._layer_index = {name: i for i, (name, _) in enumerate(ordered)}
        self._check_geometry(strict=True)

    def _check_geometry(self, *, strict: bool) -> bool:
        """The pool's geometry matches vLLM's KV slice; a mismatch is a start-up error
        (``strict``), and otherwise disables the connector with an error in the log."""
        if self._checked_geometry:
            return True
        client = self._transfer(self.settings.transfer_timeout_s)
        if client is None:
            log.warning("kvpool: no replica found yet; checking the pool's geometry later")
            return False
        try:
            geometry = client.geometry()
        except (TransferError, TransferConnectionError, OSError) as err:
            log.warning("kvpool: pool unreachable (%s); checking its geometry later", err)
            return False
        problem = self._geometry_problem(geometry)
        if problem is not None:
            if strict:
                raise ConnectorConfigError(problem)
            log.error("kvpool connector disabled: %s", problem)
            self.settings = self.settings.model_copy(update={"load": False, "save": False})
            return False
        self._checked_geometry = True
        return True

    def _geometry_problem(self, geometry: Geometry) -> str | None:
        layout = self._layout
        assert layout is not None
        if geometry.tokens_per_block != self.block_size:
            return (
                f"the pool stores {geometry.tokens_per_block} tokens per block, vLLM's "
                f"block_size is {self.block_size}: they must be equal"
            )
        if len(geometry.pools) != 1:
            return f"the pool has {len(geometry.pools)} layer pools; the connector needs one"
        pool = geometry.pools[0]
        dtype = self._views[0].dtype if self._views else None
        want = (len(self._views), layout.kv_heads, layout.head_dim, dtype)
        have = (len(pool.layers), pool.kv_heads, pool.head_dim, _torch_dtype(pool.dtype))
        if want != have:
            return (
                f"the pool's model geometry (layers, kv heads, head dim, dtype) is {have}, "
                f"this worker's KV slice is {want}"
            )
        return None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if self._loading is not None:  # the last step never reached wait_for_save
            self._finish_load()
        super().bind_connector_metadata(connector_metadata)
        self._hooks_ran = False
        self._saving = None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KvpoolConnectorMetadata) or not meta.loads or not self._views:
            return
        started = time.perf_counter()
        client = self._transfer(self.settings.transfer_timeout_s)
        items = [self._load_item(spec) for spec in meta.loads]
        if self._hooks_ran:
            # vLLM starts loads after the forward pass only in steps it believes have none:
            # too late to feed it, so these blocks fail and are recomputed.
            log.warning("kvpool: loads started after the forward pass; vLLM recomputes them")
            for item in items:
                item.count = 0
        chunks = self.settings.load_layer_chunks if self._layerwise_loads else 1
        job = LayerLoad(
            items,
            len(self._views),
            chunks,
            client=lambda: client,
            usable=lambda: self._check_geometry(strict=False),
            timeout_s=self.settings.transfer_timeout_s,
            stats=self.stats,
            on_chunk=self._load_chunk_landed,
            pin_memory=self._views[0].device.type == "cuda",
            pages_device=self._views[0].device,
            streams=self.settings.streams(),
        )
        self._loading = job
        if not job.pending:
            job.run()  # nothing to read: releases the leases
        elif self._layerwise_loads:
            job.start()
        else:
            job.run()
            for layer in range(len(self._views)):
                self._take_layer(job, layer)
        self.stats.add(load_s=time.perf_counter() - started)

    def _load_item(self, spec: LoadSpec) -> LoadItem:
        lease = spec.leases.get(self._rank)
        count = min(lease.count - spec.first, len(spec.block_ids)) if lease is not None else 0
        item = LoadItem(spec.req_id, spec.block_ids, spec.first, lease, max(0, count))
        if item.count > 0:
            device = self._views[0].device
            item.index = torch.tensor(spec.block_ids[: item.count], device=device)
        return item

    def _load_chunk_landed(self, chunk: int) -> None:
        """Called by the load thread once a layer range of every request landed or failed
        (and was announced), before it reads the next range."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._hooks_ran = True
        job = self._loading
        layer = self._layer_index.get(layer_name)
        if job is None or layer is None or layer in job.taken or not job.pending:
            return
        started = time.perf_counter()
        self._take_layer(job, layer)
        self.stats.add(load_s=time.perf_counter() - started, layer_loads=1)

    def _take_layer(self, job: LayerLoad, layer: int) -> None:
        for item in job.take(layer):
            assert item.kv is not None and item.index is not None
            self._scatter_layer(layer, item.index, item.kv[layer])

    def _scatter_layer(self, layer: int, index: torch.Tensor, kv: torch.Tensor) -> None:
        """Write one layer of landed blocks (``[n, 2, bs, heads, dim]``) into vLLM's pages."""
        scatter_layer(self._views[layer], index, kv)

    def _finish_load(self) -> set[str]:
        """The step's loads, settled: failed blocks queued for vLLM; the failed requests."""
        job, self._loading = self._loading, None
        if job is None:
            return set()
        started = time.perf_counter()
        outcome = job.finish()
        if outcome.untaken_layers and self._layerwise_loads:
            self._layerwise_loads = False
            self.stats.add(layerwise_fallbacks=1)
            log.warning(
                "kvpool: vLLM did not call wait_for_layer_load for %d of %d layers during a "
                "step with loads; those loads are recomputed and later loads complete before "
                "the forward pass",
                outcome.untaken_layers,
                len(self._views),
            )
        self.stats.add(
            loaded_blocks=outcome.loaded_blocks,
            load_error_blocks=len(outcome.failed_block_ids),
            load_s=time.perf_counter() - started,
        )
        self._load_errors.update(outcome.failed_block_ids)
        return outcome.failed_requests

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._load_errors = self._load_errors, set()
        return failed

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._hooks_ran = True
        layer = self._layer_index.get(layer_name)
        if layer is None or not self.settings.layerwise:
            return  # (not layer-wise: wait_for_save copies every layer)
        saving = self._saving or self._plan_saves()
        if saving is None:
            return
        started = time.perf_counter()
        if saving.copy(self._views, layer):
            self.stats.add(copy_out_s=time.perf_counter() - started, layer_saves=1)

    def _plan_saves(self) -> LayerSave | None:
        """This step's blocks to save, as one ``LayerSave`` (None: nothing to save)."""
        meta = self._connector_metadata
        if not isinstance(meta, KvpoolConnectorMetadata) or not self._views:
            return None
        parts: list[SavePart] = []
        block_ids: list[int] = []
        for spec in meta.saves:
            if spec.block_ids:
                start, count = len(block_ids), len(spec.block_ids)
                parts.append(SavePart(spec.req_id, spec.keys, spec.first, start, count))
                block_ids.extend(spec.block_ids)
        if not parts:
            return None
        self._saving = LayerSave(
            parts,
            block_ids,
            self._views[0],
            on_device=self._save_on_device(),
            buffers=self._buffers,
        )
        return self._saving

    def _save_on_device(self) -> bool:
        """Whether this step's save buffer goes to the pages' GPU: the same-node agent's
        arena is there (the blocks then never cross PCIe), and no earlier step's device
        buffer still waits for the sender (each holds the step's saved blocks in GPU memory
        vLLM did not budget for: at most two steps' at once)."""
        with self._client_lock:
            client = self._client
            waiting = self._device_saves
        return (
            isinstance(client, ShmClient)
            and client.device is not None
            and client.device == self._views[0].device
            and waiting == 0
        )

    def wait_for_save(self) -> None:
        failed = self._finish_load()
        saving, self._saving = self._saving or self._plan_saves(), None
        if saving is None:
            return
        started = time.perf_counter()
        parts = saving.finish(self._views)
        self.stats.add(copy_out_s=time.perf_counter() - started)
        done = saving.lend(len(parts))
        for part, kv in parts:
            # A request whose load failed computed this step over blocks never loaded.
            if part.req_id in failed:
                if done is not None:
                    done()
                continue
            if kv.is_cuda:
                with self._client_lock:
                    self._device_saves += 1
            if not self._saves.put(Save(self._ns(self._rank), part.keys, part.first, kv, done)):
                self.stats.add(saves_dropped=1)
                if done is not None:
                    done()
                if kv.is_cuda:
                    with self._client_lock:
                        self._device_saves -= 1

    def _send_save(self, save: Save) -> None:
        """In the sender thread (``SaveQueue``): PUT one save; a failure is counted, never
        raised. On a CPU engine no torch operation that may run in parallel belongs in this
        thread: an OpenMP team beside vLLM's made vLLM's compute threads sleep instead of
        spin, and every request slower (docs/vllm.md, "Measured"). The save's buffer is
        contiguous, so the clients move it with plain copies."""
        keys, first = save.keys, save.first
        try:
            client = self._save_client(self.settings.transfer_timeout_s)
            if client is None or not self._check_geometry(strict=False):
                raise TransferConnectionError("no usable replica", request_sent=False)
            priority = self.settings.priority
            result = client.put(save.ns, keys, [save.kv], first=first, priority=priority)
            near = result.stored if _through_socket(client, result.replica) else 0
            self.stats.add(save_requests=1, saved_blocks=result.stored, node_saved_blocks=near)
        except (TransferError, TransferConnectionError, OSError) as err:
            self.stats.add(save_errors=1)
            log.warning("kvpool: save of %d blocks failed (%s)", len(keys) - first, err)
        finally:
            if save.kv.is_cuda:
                with self._client_lock:
                    self._device_saves -= 1

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Send the queued saves now and wait until each was sent (or failed); False on
        timeout."""
        return self._saves.flush(timeout_s)

    def shutdown(self) -> None:
        self._saves.close(FLUSH_TIMEOUT_S)
        with self._client_lock:
            if self._saver is not None:
                self._saver[1].close()  # the sibling only: a routed saver shares the TCP pool
                self._saver = None
            if self._local is not None:
                self._local.close()
                self._local = self._routed = None
            if self._client is not None:
                self._client.close()
                self._client = None


def _worker_rank() -> int:
    """This worker's parallel rank: tensor rank + tensor size x pipeline rank."""
    from vllm.distributed.parallel_state import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    tp_rank = get_tensor_model_parallel_rank()
    return int(tp_rank + get_tensor_model_parallel_world_size() * get_pp_group().rank_in_group)


def _torch_dtype(name: str) -> torch.dtype | None:
    from kvpool_agent.dataplane.client import TORCH_DTYPES

    return TORCH_DTYPES.get(name)
