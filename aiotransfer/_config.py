"""Configuration: one frozen object, read from the environment in exactly one place."""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = ["AuxPath", "TransferConfig", "aux_tcp_forced"]

ENV_PREFIX = "AIOTRANSFER_"


class AuxPath(str, enum.Enum):
    """Which path ``send_aux`` uses (see :func:`aiotransfer._aux_state.select_aux_path`)."""

    AUTO = "auto"
    ENGINE = "engine"
    TCP = "tcp"


def _positive(name: str, value: float | None, *, allow_none: bool = False) -> None:
    if value is None:
        if not allow_none:
            raise ConfigError(f"{name} must be set")
        return
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class TransferConfig:
    """Everything a :class:`~aiotransfer.KVManager` needs besides its buffers.

    Timeouts are seconds. Every public coroutine takes ``timeout=DEFAULT`` meaning "use the matching
    default here"; ``timeout=None`` (the waits ``wait_ready``, ``done``, ``released`` only) is no bound of
    the call's own, and the room's own bounds (liveness, the release quarantine) still end it.
    """

    engine: str = "mooncake"
    """Engine name: ``mooncake``, ``mooncake_tcp`` (forces TCP), ``nixl``, ``mori`` or a registered name; ``memory``
    is the in-process engine for tests (:mod:`aiotransfer.testing`)."""
    protocol: str | None = None
    """Mooncake protocol; ``None`` falls back to ``$MOONCAKE_PROTOCOL`` then ``"rdma"``."""
    hostname: str = "127.0.0.1"
    """Address peers reach this rank at (engine and control plane)."""
    control_port: int = 0
    """Port of this rank's control socket; 0 picks a free one."""
    rdma_devices: str | None = None
    """RDMA device list: a comma list or a JSON map ``{gpu_id: "mlx5_0,mlx5_1"}`` (Mooncake)."""
    bootstrap: str | None = None
    """Control endpoint of the prefill bootstrap leader (unique rank 0) that this prefill rank registers
    with. ``None`` on the leader and on single-rank deployments."""
    dp_size: int = 1
    """Prefill attention-DP groups behind one bootstrap leader (decode picks ``room % dp_size``)."""
    all_cp_ranks_send: bool = False
    """With prefill context parallelism, let every CP rank send its pages (default: only CP rank 0)."""
    device_id: int | None = None
    """Accelerator device of this rank; set before the engine is created, and on executor threads."""

    aux_path: AuxPath | str = AuxPath.AUTO
    custom_mem_pool: str | None = None
    """``NVLINK``, ``INTRA_NODE_NVLINK`` or ``BAREX`` when KV lives in a custom pool (drives aux path)."""

    handshake_timeout: float = 10.0
    """Bound on first contact with a peer: registration round trip and engine handshake. A Mooncake peer
    that does not answer the handshake's metadata request within it is refused before the engine (whose own
    wait, under its engine-wide mutex, is 60 s) ever contacts it."""
    ready_timeout: float = 300.0
    """Default bound for ``KVSender.wait_ready`` (decode's page indices arriving)."""
    transfer_timeout: float = 60.0
    """Default bound for one ``send_kv`` / ``send_state`` / ``send_aux`` call."""
    done_timeout: float = 300.0
    """Default bound for ``done()`` on either side."""
    engine_timeout_s: int | None = 30
    """Mooncake's own per-transfer timeout (``MC_TRANSFER_TIMEOUT``, min 5; also sets
    ``MC_TCP_STATUS_TIMEOUT_SEC``). Past it a write fails but may still be in flight: its memory stays
    pinned until the engine ends it (docs/engines.md). ``None`` leaves the environment untouched."""
    engine_log_level: str = "ERROR"
    """glog level of the engine (``MC_LOG_LEVEL``); an explicit environment value wins."""
    engine_metadata_refresh_s: int | None = None
    """Have Mooncake re-read every peer descriptor it caches this often
    (``MC_TE_METADATA_REFRESH_INTERVAL_SECONDS``). Not needed for restarted peers (the adapter re-fetches a
    known peer whose handshake fails); it also polls every dead peer forever, logging an error each time.
    ``None`` leaves the environment untouched (the engine's default: never)."""

    max_entries_in_flight: int = 1024
    """Engine entries in flight per peer (Mooncake rejects beyond ~2,048 queued per peer)."""
    max_batch_entries: int = 1024
    """Largest single engine batch; bigger plans are split."""
    max_rooms: int = 65536
    """Rooms tracked at once per manager; beyond that new senders/receivers wait or fail."""
    max_sockets: int = 512
    """Outbound control sockets cached per manager; the least recently used is evicted and kept open up to 60 s
    (a message to its peer takes it back, with its connection). Beyond this many evicted ones the oldest is
    closed: one evicted less than 5 s ago is handed over to ZeroMQ with the rest of that time as linger (it is
    never closed with what it queued). ZeroMQ's socket limit is set to three times this plus two; past it a
    send waits for room, within its timeout. Made smaller, with a warning, when the process's file descriptor
    limit (``ulimit -n``) cannot carry about 9 per socket."""
    max_message_bytes: int = 16 * 1024 * 1024
    """Largest control message accepted, all its frames together: a bigger one is discarded while it is read,
    before it is assembled (see docs/security.md for what ZeroMQ itself buffers). Sized from the largest
    message a peer sends within the per-field bounds of ``aiotransfer._control.messages``: a transfer
    request for a room of ``MAX_ROOM_PAGES`` (1 Mi) pages is 4 MiB of page indices, plus up to 5 MiB for each
    state kind indexed by page (at most 5 bytes per index), 14 MiB with two such kinds; a registration
    (``Hello``) with every buffer list at ``MAX_BUFFERS`` is about 0.7 MiB plus its engine info (at most
    8 MiB); a TCP aux slot (``AuxData``) at most 4 MiB; a topology of ``MAX_RANKS`` ranks about 4.3 MiB.
    Raise it only with rooms that name more state indices than that."""
    max_peers: int = 4096
    """Peers whose liveness (last sign of life, blacklisting, incarnation) is tracked at once; only peers a
    room of this manager depends on are tracked, and the least recently needed is forgotten first. Also the
    decode ranks registered with a prefill at once: past it the least recently used registration that nothing
    holds is forgotten (see ``registration_idle_s``), and only when every one is held is a new registration
    dropped (``dropped_too-many-peers``)."""
    max_pending_per_room: int = 64
    """Transfer requests stashed for one room whose sender does not exist yet (one per decode rank)."""
    max_pending_bytes: int = 256 * 1024 * 1024
    """Bytes of page indices stashed for rooms whose sender does not exist yet, all rooms together."""
    max_pending_per_peer: int = 4096
    """Transfer requests from one decode rank held before they can be served, all rooms together: stashed for
    rooms whose sender does not exist yet, or waiting for that rank's registration to be checked. A decode rank
    asks once per room it runs with this prefill, and a request waits here only until the prefill's scheduler
    opens the room: at most the requests that rank has running or pre-allocated (hundreds in vLLM's and
    SGLang's decode batches). 4,096 leaves ample margin over that and keeps one rank (or a host sending in
    its name) from filling the stash that ``max_rooms`` bounds for every rank. A request beyond it is refused,
    and its decode rank fails the room with the reason (``pending_refused``)."""
    max_staging_requests_per_room: int = 64
    """Decode side: staging requests of one room from one prefill rank held at once, waiting for space in our
    arena or granted and not yet used. A prefill rank asks for a piece only while it holds a slice of its own
    arena for it, and every piece but a call's last is at least half of ``min(its arena / 4, ours / 4,
    8 MiB)`` (``StagingWriter``, ``piece_pages``): one room holds at most ``max(8, 8 x its arena / ours,
    its arena / 4 MiB)`` slices, plus its last piece and the pieces whose ``Staged`` is on its way. With both
    arenas at the default 64 MiB that is 17 or so; 64 covers a prefill arena up to 240 MiB, and up to 7.5
    times ours. A request beyond it is refused at once with the reason (``dropped_staging-over-cap``): the
    piece's room fails on the prefill."""
    max_staging_requests_per_peer: int = 1024
    """Decode side: staging requests held at once from one prefill rank, all its rooms together (as
    ``max_staging_requests_per_room``). Its pieces in flight share its one arena, so their number is bounded by
    that arena over the smallest piece, a room's last (a page, or a few tokens): 1,024 covers the default
    64 MiB shared out in pieces of 64 KiB, many small rooms each sending its last piece at once. A request
    held costs about 3 KiB (a task waiting for space, bounded by ``transfer_timeout``): about 3 MiB per prefill
    rank. A request beyond it is refused at once with the reason (``dropped_staging-over-cap``)."""
    max_staging_share_per_room: float = 0.5
    """Decode side: the most of our staging arena one room holds at once, granted to its pieces and not yet
    scattered, all its prefill ranks together, as a share of ``staging_bytes`` (0.25 to 1). A piece is at
    most a quarter of either arena (``piece_pages``), so a room always has room for one; a request that would
    take the room past its share waits for space as it would for the arena's, bounded by
    ``transfer_timeout``. So a room whose prefill falls silent holds at most this share, and the rest of the
    arena serves the other rooms."""
    executor_threads: int = 2
    """Threads of the engine's offload executor; more spinning threads are slower on small hosts."""
    engine_threads: str = "normal"
    """``"background"`` runs the native engine's own threads under ``SCHED_IDLE`` (Linux): the event loop
    and every other normal thread preempt them, so the loop stays responsive while transfers saturate the
    cores, but transfers slow down when all cores are busy with other work. Taken only by engines whose
    threads sleep while idle (Mooncake); on others (NIXL's busy-polling UCX thread) a warning, and threads
    stay normal. ``"normal"`` leaves them alone. See docs/performance.md."""
    nixl_progress_delay_us: int = 0
    """NIXL's UCX progress thread: ``0`` (NIXL's own choice) polls without pause and keeps a core busy in
    every process; ``N > 0`` lets it sleep up to N µs on the worker's events between polls. Frees the core
    (large writes and the loop gain where cores are few) at the cost of wake-up latency for small writes;
    measured in docs/performance.md."""
    poll_interval_min: float = 0.0001
    """Shortest sleep between timed polls of the engine's statuses (writes of many entries, or many writes,
    in flight; one or two small writes are polled between the loop's other callbacks instead). asyncio's
    timers wake the loop through ``epoll_wait``'s millisecond timeout, so below 1 ms this is 1.1 ms in effect
    unless ``fine_poll_timer`` is on."""
    poll_interval_max: float = 0.001
    fine_poll_timer: bool = False
    """Sleep between timed polls on a Linux ``timerfd`` the loop watches, so that ``poll_interval_min`` below
    1 ms holds, while at most 128 entries are in flight (more keep the loop's timers: each poll round costs
    the loop about 30 µs). A room of many small entries then completes earlier, for more of the loop's CPU:
    measured on 2 vCPUs (a one-page room over 64 KV buffers on Mooncake TCP), 0.45 ms less wall time and
    0.45 ms more CPU per room. Ignored where there is no timerfd. See docs/performance.md."""
    yield_after_notify: bool = True
    """When a room's Success (prefill) or transfer request (decode) leaves while no other transfer of this
    manager is in flight, yield the CPU once (``os.sched_yield``) so ZMQ's I/O thread sends it at once. Only on engines whose threads sleep while idle
    (Mooncake). On a 2-vCPU host this cut the notification hop from ~185 to ~125 us (``bench --phases e2e``);
    with idle cores it is a ~1 us no-op. Turn it off if your process keeps busy-spinning threads (the
    yield would wait behind one for a time slice, ~1-3 ms)."""
    pending_request_ttl: float = 600.0
    """How long transfer requests for a room nobody created a sender for are kept."""
    registration_idle_s: float = 600.0
    """A decode rank's registration with a prefill that no room has used for this long is forgotten (its next
    request is answered "register again"). A registration also ends when its decode registers again; at
    ``max_peers`` held, the least recently used one no room holds makes room for a new
    decode (``stats()['decode_peers_forgotten']``)."""
    tombstone_ttl: float = 600.0
    """Prefill side: how long a room that failed here (aborted by its decode, or drained) is remembered, so
    that a transfer request for it arriving late is refused with the room's reason, and a sender opened for
    it fails at once (at most ``max_rooms`` are kept; ``stats()['tombstones']``)."""

    lag_probe_interval: float = 0.01
    """Period of the event-loop lag probe feeding ``stats()['latency']['loop_lag']``; 0 disables it. Its cost on an
    idle manager (``mooncake_tcp``, loop thread CPU, busy 2-vCPU host): 16-20 ms per second at 0.01, 5 ms at
    0.05, 2-4 ms at 0.1, against 0.4-1.3 ms with the probe off. The default is chosen for what the probe
    sees: it measures a stall only while its own wake-up is due, so a stall shorter than the period may fall
    between two wake-ups and go unseen; at 0.01 every stall over 10 ms shows, for about 2 % of one core.
    A deployment that reads the lag elsewhere can set 0."""
    heartbeat_interval: float = 1.0
    """Seconds between liveness pings to every peer with an open room."""
    peer_timeout: float = 3.0
    """A peer silent this long is declared dead: its rooms fail on this side (the other side does the
    same on its own), it is blacklisted and probed until it answers again."""
    release_quarantine_s: float | None = None
    """The bound on what the engine never ends. Decode side: how long a failed room's pages stay out of reach
    when the prefill can neither acknowledge a drain nor be proven gone (see "Page lifecycle"); after it
    they are released with a warning and ``stats()['quarantines_expired']``. Prefill side: how long after
    its write failed an engine write the engine has still not ended is left alone; after it the handle is
    abandoned with a warning and ``stats()['engine_expired']``: the engine is asked to let go (Mooncake over
    TCP cuts its connections to the peer), and the memory comes back once it has; a write the engine cannot
    let go of keeps it (``stats()['engine_held']``; docs/engines.md, "Past the release quarantine"). None:
    twice the engine's own transfer timeout (``engine_timeout_s``, or 30 s) plus ``peer_timeout``."""
    checksum: bool = False
    """End-to-end CRC32 of every transferred byte, verified by decode before it reports Success."""
    staging: str = "auto"
    """Gather/scatter through a staging arena: ``auto`` (cost model), ``always`` or ``never``."""
    staging_bytes: int = 64 * 1024 * 1024
    """Size of this manager's staging arena (registered; on the KV's device); 0 disables staging."""
    staging_backend: str = "auto"
    """What gathers and scatters staged pages: ``auto`` (torch when the KV lives on a device, NumPy for host
    memory), ``numpy`` (host memory only: refused for device KV), or ``torch`` (needs torch; runs the
    device code path on host tensors too). With torch the arena is a tensor on the KV's device and, on
    CUDA, the copies run on their own stream. Either side of a transfer may use either backend: the staged
    bytes are laid out the same. See docs/engines.md, "KV on a GPU"."""

    wire: str = "native"
    """Control-plane protocol: ``native`` (ours) or ``sglang-mooncake`` (talk to unmodified SGLang 0.5.x
    prefill/decode processes over their Mooncake backend; see docs/sglang.md)."""
    sglang_bootstrap_port: int = 0
    """``sglang-mooncake`` prefill leader: serve SGLang's bootstrap HTTP API on this port."""
    sglang_kv_cache_dtype: str = "auto"
    """``sglang-mooncake``: the ``kv_cache_dtype`` string both sides compare (SGLang's server argument)."""

    hmac_key: bytes | None = None
    """Shared secret: when set, every control message is signed and verified."""
    control_curve: bool | None = None
    """Authenticate (and encrypt) every control connection with CurveZMQ keys derived from ``hmac_key``, so
    that a host without the secret cannot complete a handshake and gets no frame buffered at all (see
    docs/security.md). ``None`` (the default): on whenever ``hmac_key`` is set. Every manager that talks to
    this one must agree: ``False`` only to talk to managers that do not use it (earlier versions signed
    without it), at the price of what a host without the key can then make ZeroMQ buffer."""

    def __post_init__(self) -> None:
        if not self.engine:
            raise ConfigError("engine must be a non-empty name")
        try:
            object.__setattr__(self, "aux_path", AuxPath(self.aux_path))
        except ValueError:
            raise ConfigError(
                f"aux_path must be one of {[p.value for p in AuxPath]}, got {self.aux_path!r}"
            ) from None
        for name in ("handshake_timeout", "ready_timeout", "transfer_timeout", "done_timeout",
                     "heartbeat_interval", "peer_timeout", "tombstone_ttl", "registration_idle_s"):
            _positive(name, getattr(self, name))
        for name in (
            "max_entries_in_flight",
            "max_batch_entries",
            "max_rooms",
            "max_sockets",
            "max_message_bytes",
            "max_peers",
            "max_pending_per_room",
            "max_pending_bytes",
            "max_pending_per_peer",
            "max_staging_requests_per_room",
            "max_staging_requests_per_peer",
            "executor_threads",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_staging_requests_per_room > self.max_staging_requests_per_peer:
            raise ConfigError(
                f"max_staging_requests_per_room ({self.max_staging_requests_per_room}) must not exceed "
                f"max_staging_requests_per_peer ({self.max_staging_requests_per_peer}): a room's pieces are its "
                "prefill rank's too"
            )
        if not 0.25 <= self.max_staging_share_per_room <= 1.0:
            raise ConfigError(
                f"max_staging_share_per_room must be between 0.25 and 1, got {self.max_staging_share_per_room!r}: "
                "a staged piece may take a quarter of the arena"
            )
        if self.max_batch_entries > self.max_entries_in_flight:
            object.__setattr__(self, "max_batch_entries", self.max_entries_in_flight)
        if self.engine_timeout_s is not None and self.engine_timeout_s < 5:
            raise ConfigError("engine_timeout_s must be >= 5 (Mooncake's minimum) or None")
        refresh = self.engine_metadata_refresh_s
        if refresh is not None and (not isinstance(refresh, int) or refresh < 1):
            raise ConfigError(f"engine_metadata_refresh_s must be an integer >= 1 or None, got {refresh!r}")
        if self.wire not in ("native", "sglang-mooncake"):
            raise ConfigError(f"wire must be 'native' or 'sglang-mooncake', got {self.wire!r}")
        if self.wire == "sglang-mooncake":
            if not self.engine.startswith("mooncake"):
                raise ConfigError("the sglang-mooncake wire profile needs a Mooncake engine")
            if self.hmac_key is not None or self.control_curve:
                raise ConfigError("the sglang-mooncake wire profile cannot sign messages (SGLang has no HMAC)")
            if self.checksum:
                raise ConfigError("the sglang-mooncake wire profile cannot carry checksums")
        if self.control_curve and self.hmac_key is None:
            raise ConfigError("control_curve derives its keys from the shared secret: set hmac_key too")
        if self.engine_threads not in ("normal", "background"):
            raise ConfigError(f"engine_threads must be normal or background, got {self.engine_threads!r}")
        if not 0 <= self.nixl_progress_delay_us <= 1_000_000:
            raise ConfigError(f"nixl_progress_delay_us must be 0..1000000, got {self.nixl_progress_delay_us!r}")
        if self.staging not in ("auto", "always", "never"):
            raise ConfigError(f"staging must be auto, always or never, got {self.staging!r}")
        if self.staging_backend not in ("auto", "numpy", "torch"):
            raise ConfigError(f"staging_backend must be auto, numpy or torch, got {self.staging_backend!r}")
        if self.staging_backend == "torch" and importlib.util.find_spec("torch") is None:
            raise ConfigError("staging_backend='torch' needs torch: pip install 'aiotransfer[torch]'")
        if self.release_quarantine_s is not None:
            _positive("release_quarantine_s", self.release_quarantine_s)
        if self.staging_bytes < 0:
            raise ConfigError("staging_bytes must be >= 0")
        if not 0 < self.poll_interval_min <= self.poll_interval_max:
            raise ConfigError("need 0 < poll_interval_min <= poll_interval_max")
        if isinstance(self.hmac_key, str):
            object.__setattr__(self, "hmac_key", self.hmac_key.encode())
        if not (0 <= self.control_port < 65536):
            raise ConfigError(f"control_port out of range: {self.control_port}")

    @property
    def quarantine_s(self) -> float:
        """The release quarantine in effect (``release_quarantine_s`` or its derived default)."""
        if self.release_quarantine_s is not None:
            return self.release_quarantine_s
        return 2.0 * float(self.engine_timeout_s or 30) + self.peer_timeout

    def replace(self, **changes: Any) -> TransferConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> TransferConfig:
        """Build a config from ``AIOTRANSFER_*`` variables (and ``MOONCAKE_PROTOCOL``); overrides win.

        ``AIOTRANSFER_<FIELD>`` sets any field (upper-case name). ``AIOTRANSFER_SEND_AUX_TCP=1`` forces
        the TCP aux path.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None or raw == "":
                continue
            values[f.name] = _parse_field(f.name, f.type, raw)
        if _truthy(env.get(ENV_PREFIX + "SEND_AUX_TCP")):
            values["aux_path"] = AuxPath.TCP
        values.update(overrides)
        return cls(**values)


def aux_tcp_forced(env: Mapping[str, str] | None = None) -> bool:
    """``AIOTRANSFER_SEND_AUX_TCP=1`` forces the TCP aux path, whatever the config says."""
    env = os.environ if env is None else env
    return _truthy(env.get(ENV_PREFIX + "SEND_AUX_TCP"))


def _truthy(raw: str | None) -> bool:
    return raw is not None and raw.strip().lower() in {"1", "true", "yes", "on"}


def _parse_field(name: str, annotation: Any, raw: str) -> Any:
    text = str(annotation)
    try:
        if name == "hmac_key":
            return raw.encode()
        if "float" in text:
            return float(raw)
        if "int" in text:
            return int(raw)
        if "bool" in text:
            return _truthy(raw)
    except ValueError:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {text}") from None
    return raw
