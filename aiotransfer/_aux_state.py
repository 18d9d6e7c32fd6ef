"""Aux and state: path selection (pure), state types, and metadata-buffer allocation.

Aux buffers hold small per-request metadata (first output token, logprobs, hidden states for
speculative decoding): one slot per request, ``item_len`` bytes per slot and per buffer.

Path rule (:func:`select_aux_path`):

=========================  ================  ==========================================================
custom memory pool         ``aux_path=auto``  why
=========================  ================  ==========================================================
``NVLINK`` (or ``BAREX``)  TCP               the NVLink transport cannot move host memory
``INTRA_NODE_NVLINK``      engine            aux buffers are allocated on the device
(none)                     engine            falls back to TCP if the engine path fails
=========================  ================  ==========================================================

``aux_path=tcp`` or ``AIOTRANSFER_SEND_AUX_TCP=1`` always gives TCP; ``aux_path=engine`` gives the engine
(and is refused with an ``NVLINK`` pool). State types (:class:`StateType`) each have their own buffers.
"""

from __future__ import annotations

import enum
from typing import Any

from ._config import AuxPath
from .errors import ConfigError

__all__ = ["MemPool", "StateType", "alloc_metadata_buffer", "metadata_device", "select_aux_path"]


class StateType(str, enum.Enum):
    """Kinds of per-request state sent alongside KV. Any other string is accepted as a custom kind."""

    MAMBA = "mamba"
    """Recurrent state: one slot per request per state tensor."""
    SWA = "swa"
    """Sliding-window attention KV: page indices in its own pool, coalesced like KV."""
    NSA = "nsa"
    """Sparse-attention indexer cache (DeepSeek NSA/DSA): page indices in its own pool."""

    @classmethod
    def slot_based(cls, kind: str) -> bool:
        """True for kinds addressed by one slot per request rather than by pages."""
        return kind == cls.MAMBA.value


class MemPool(str, enum.Enum):
    """Custom memory pools that change how aux must travel."""

    NONE = "none"
    NVLINK = "NVLINK"
    BAREX = "BAREX"
    INTRA_NODE_NVLINK = "INTRA_NODE_NVLINK"

    @classmethod
    def parse(cls, value: str | None) -> MemPool:
        if value is None or value == "" or value.lower() in ("none", "false", "0"):
            return cls.NONE
        if value.lower() == "true":
            return cls.NVLINK
        try:
            return cls(value.upper())
        except ValueError:
            raise ConfigError(
                f"unknown custom memory pool {value!r}; expected NVLINK, BAREX or INTRA_NODE_NVLINK"
            ) from None


def select_aux_path(config_path: AuxPath | str, pool: MemPool | str | None, *, env_force_tcp: bool) -> AuxPath:
    """The aux path for this manager (pure).

    Args:
        config_path: ``TransferConfig.aux_path``.
        pool: The engine's custom memory pool (``MC_CUSTOM_MEM_POOL``), or None.
        env_force_tcp: The environment forces aux over TCP.

    Returns:
        ``ENGINE`` or ``TCP``; never ``AUTO``.

    Raises:
        ConfigError: ``engine`` asked for with a pool that cannot move host memory.
    """
    path = AuxPath(config_path)
    mem = pool if isinstance(pool, MemPool) else MemPool.parse(pool)
    if env_force_tcp or path is AuxPath.TCP:
        return AuxPath.TCP
    host_unreachable = mem in (MemPool.NVLINK, MemPool.BAREX)
    if path is AuxPath.ENGINE:
        if host_unreachable:
            raise ConfigError(
                f"aux_path=engine with the {mem.value} memory pool: that transport cannot move host memory; "
                "use aux_path=auto/tcp, or INTRA_NODE_NVLINK with device-resident aux buffers"
            )
        return AuxPath.ENGINE
    return AuxPath.TCP if host_unreachable else AuxPath.ENGINE


def metadata_device(pool: MemPool | str | None, device_id: int | None) -> str:
    """Where metadata (aux) buffers belong: the accelerator for ``INTRA_NODE_NVLINK``, else host memory."""
    mem = pool if isinstance(pool, MemPool) else MemPool.parse(pool)
    if mem is MemPool.INTRA_NODE_NVLINK:
        return f"cuda:{device_id or 0}"
    return "cpu"


def alloc_metadata_buffer(
    slots: int, item_shape: tuple[int, ...], dtype: Any, *, pool: MemPool | str | None = None,
    device_id: int | None = None,
) -> Any:
    """Allocate one aux buffer ``(slots, *item_shape)`` as a torch tensor on the device the rule picks.

    Host buffers are pinned when CUDA is available (faster engine reads); device buffers are used with
    ``INTRA_NODE_NVLINK`` so the engine can move them over NVLink.

    Args:
        slots: Aux slots (one per request in flight).
        item_shape: The shape of one slot.
        dtype: A torch dtype.
        pool: The engine's custom memory pool, as for
            `select_aux_path`.
        device_id: The CUDA device for ``INTRA_NODE_NVLINK``.

    Returns:
        A zeroed torch tensor ``(slots, *item_shape)``.

    Raises:
        ConfigError: The rule picks a device this process cannot use.
    """
    import torch

    device = metadata_device(pool, device_id)
    if device != "cpu":
        index = int(device.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ConfigError(f"INTRA_NODE_NVLINK puts aux buffers on {device}, which this process cannot use "
                              f"({torch.cuda.device_count()} CUDA devices visible)")
        return torch.zeros((slots, *item_shape), dtype=dtype, device=device)
    pin = bool(torch.cuda.is_available())
    return torch.zeros((slots, *item_shape), dtype=dtype, pin_memory=pin)
