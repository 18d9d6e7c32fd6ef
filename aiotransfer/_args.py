"""``KVArgs``: the memory one rank offers for transfer (KV pages, aux slots, state slots).

A buffer may be a torch tensor, a NumPy array, or a raw ``(ptr, nbytes)`` pair. Each buffer has an
item length: bytes per page (KV, paged state) or per request slot (aux, Mamba state). For arrays and
tensors the item length defaults to ``nbytes // shape[0]`` (first dimension = pages / slots).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._control.messages import MAX_BUFFERS, MAX_STATE_KINDS
from ._convert import PageGeometry, page_geometry
from .errors import InvalidArgument

__all__ = ["Buffer", "KVArgs", "resolve_buffer"]

BufferLike = Any
"""A torch tensor, a NumPy array, or ``(ptr, nbytes)``."""


@dataclass(frozen=True)
class Buffer:
    """A resolved buffer: address, size, item length, and the object that keeps the memory alive."""

    ptr: int
    nbytes: int
    item_len: int
    device: str = "cpu"
    layer_id: int = -1
    owner: Any = field(default=None, compare=False, repr=False)

    @property
    def num_items(self) -> int:
        return self.nbytes // self.item_len


def _describe(obj: Any) -> tuple[int, int, int | None, str]:
    """(ptr, nbytes, first-dim length or None, device) of a tensor / array / (ptr, nbytes)."""
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(v, int) for v in obj):
        return obj[0], obj[1], None, "cpu"
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # torch.Tensor, without importing torch
        if not obj.is_contiguous():
            raise InvalidArgument("tensor buffers must be contiguous (call .contiguous() first)")
        device = str(obj.device)
        first = int(obj.shape[0]) if obj.dim() > 0 else None
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size()), first, device
    if hasattr(obj, "ctypes") and hasattr(obj, "flags"):  # numpy.ndarray
        if not obj.flags.c_contiguous:
            raise InvalidArgument("array buffers must be C-contiguous (np.ascontiguousarray)")
        if not obj.flags.writeable:
            raise InvalidArgument("array buffers must be writeable")
        first = int(obj.shape[0]) if obj.ndim > 0 else None
        return int(obj.ctypes.data), int(obj.nbytes), first, "cpu"
    raise InvalidArgument(
        f"unsupported buffer {type(obj).__name__}: give a torch tensor, a NumPy array or (ptr, nbytes)"
    )


def resolve_buffer(obj: BufferLike, item_len: int | None, *, what: str, layer_id: int = -1) -> Buffer:
    ptr, nbytes, first, device = _describe(obj)
    if item_len is None:
        if not first:
            raise InvalidArgument(f"{what}: give its item length (bytes per page/slot) for a raw pointer")
        item_len = nbytes // first
    if ptr <= 0:
        raise InvalidArgument(f"{what}: null pointer")
    if item_len <= 0 or nbytes <= 0:
        raise InvalidArgument(f"{what}: empty buffer or non-positive item length ({item_len})")
    if nbytes % item_len:
        raise InvalidArgument(f"{what}: {nbytes} bytes is not a whole number of {item_len}-byte items")
    return Buffer(ptr, nbytes, item_len, device, layer_id, obj)


def _resolve_list(
    buffers: Sequence[BufferLike], item_lens: int | Sequence[int] | None, what: str,
    layer_ids: Sequence[int] | None = None,
) -> list[Buffer]:
    if isinstance(item_lens, int) or item_lens is None:
        lens: list[int | None] = [item_lens] * len(buffers)
    else:
        lens = list(item_lens)
        if len(lens) != len(buffers):
            raise InvalidArgument(f"{what}: {len(buffers)} buffers but {len(lens)} item lengths")
    if layer_ids is not None and len(layer_ids) != len(buffers):
        raise InvalidArgument(f"{what}: {len(buffers)} buffers but {len(layer_ids)} layer ids")
    if len(buffers) > MAX_BUFFERS:
        raise InvalidArgument(f"{what}: at most {MAX_BUFFERS} buffers (a peer refuses a registration with more), "
                              f"got {len(buffers)}")
    return [
        resolve_buffer(b, n, what=f"{what}[{i}]", layer_id=-1 if layer_ids is None else int(layer_ids[i]))
        for i, (b, n) in enumerate(zip(buffers, lens, strict=True))
    ]


@dataclass
class KVArgs:
    """The memory and geometry of one rank.

    ``kv_buffers`` are indexed by page: buffer ``b``'s page ``p`` lives at ``ptr_b + p * item_len_b``.
    The layer-first layout passes one buffer per (K or V, layer); a page-first layout passes one buffer
    whose page holds every layer.

    Buffers must not overlap, except that one region may be given more than once with the same address
    and size: a state buffer may be a KV buffer (vLLM's hybrid allocator keeps attention pages and Mamba
    state in one pool of pages, a block id belonging to one or the other). The memory is registered once;
    keeping the pages a room writes apart is then the caller's part.
    """

    kv_buffers: Sequence[BufferLike]
    kv_item_lens: int | Sequence[int] | None = None
    page_size: int = 1
    """Tokens per page."""
    dtype: str = "unknown"
    layout: str = "layer_first"
    head_order: str = "NHD"
    """Inside a page (or a page's sub-block of one layer): ``NHD`` token-major rows of heads, or ``HND``
    head-major (each head's tokens together). Peers that differ are converted while staging."""
    kv_layer_ids: Sequence[int] | None = None
    aux_buffers: Sequence[BufferLike] = ()
    aux_item_lens: int | Sequence[int] | None = None
    state_buffers: Mapping[str, Sequence[BufferLike]] = field(default_factory=dict)
    state_item_lens: Mapping[str, int | Sequence[int] | None] = field(default_factory=dict)
    state_dims: Mapping[str, Sequence[int]] = field(default_factory=dict)
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    kv_heads: int = 0
    """KV heads held by this rank (0: unknown; then TP sizes must match or the layout be MLA)."""
    total_kv_heads: int = 0
    num_layers: int = 0
    """Layers held by this rank; needed by the page-first layouts to find rows within a page."""
    cp_size: int = 1
    cp_rank: int = 0
    dp_rank: int = 0

    def __post_init__(self) -> None:
        if not self.kv_buffers:
            raise InvalidArgument("KVArgs needs at least one KV buffer")
        if self.page_size < 1:
            raise InvalidArgument("page_size must be >= 1")
        if not (0 <= self.tp_rank < self.tp_size) or not (0 <= self.pp_rank < self.pp_size):
            raise InvalidArgument("rank out of range of its parallel size")
        if not (0 <= self.cp_rank < self.cp_size) or self.dp_rank < 0:
            raise InvalidArgument("cp/dp rank out of range")
        if self.layout not in ("layer_first", "page_first", "page_first_kv_split", "mla"):
            raise InvalidArgument(
                f"unknown layout {self.layout!r}: layer_first, page_first, page_first_kv_split or mla"
            )
        if self.head_order not in ("NHD", "HND"):
            raise InvalidArgument(f"unknown head_order {self.head_order!r}: NHD (token-major) or HND (head-major)")
        if self.kv_heads and self.total_kv_heads and self.kv_heads > self.total_kv_heads:
            raise InvalidArgument("kv_heads exceeds total_kv_heads")
        if len(self.state_buffers) > MAX_STATE_KINDS:
            raise InvalidArgument(f"at most {MAX_STATE_KINDS} state kinds, got {len(self.state_buffers)}")
        self.kv: list[Buffer] = _resolve_list(self.kv_buffers, self.kv_item_lens, "kv", self.kv_layer_ids)
        self.aux: list[Buffer] = _resolve_list(self.aux_buffers, self.aux_item_lens, "aux")
        self.state: dict[str, list[Buffer]] = {
            kind: _resolve_list(bufs, self.state_item_lens.get(kind), f"state[{kind}]")
            for kind, bufs in self.state_buffers.items()
        }
        devices = sorted({b.device for b in self.kv})
        if len(devices) > 1:
            raise InvalidArgument(
                f"KV buffers live on several devices ({', '.join(devices)}): every KV buffer of a rank must be on "
                "one device (one registration, one staging path); aux and state buffers may live elsewhere"
            )
        regions = [(b.ptr, b.ptr + b.nbytes) for b in self.all_buffers()]
        self._check_overlaps(regions)

    def all_buffers(self) -> list[Buffer]:
        out = list(self.kv) + list(self.aux)
        for bufs in self.state.values():
            out.extend(bufs)
        return out

    @staticmethod
    def _check_overlaps(regions: list[tuple[int, int]]) -> None:
        spans = sorted(set(regions))
        for (s0, e0), (s1, _e1) in itertools.pairwise(spans):
            if s1 < e0:
                raise InvalidArgument(f"buffers overlap: [{s0:#x}, {e0:#x}) and one starting at {s1:#x}")

    @property
    def kv_device(self) -> str:
        """Where the KV buffers live: ``cpu``, or a device such as ``cuda:0``."""
        return self.kv[0].device

    @property
    def num_pages(self) -> int:
        """Pages addressable in every KV buffer (the smallest buffer bounds page indices)."""
        return min(b.num_items for b in self.kv)

    @property
    def outer(self) -> int:
        """Sub-blocks per page: 2 x layers (page_first), layers (page_first_kv_split), else 1."""
        if self.layout == "page_first":
            return 2 * max(self.num_layers, 1)
        if self.layout == "page_first_kv_split":
            return max(self.num_layers, 1)
        return 1

    def buffer_layers(self) -> list[int] | None:
        """The layer each KV buffer holds: ``kv_layer_ids`` when given, else buffer ``b`` holds layer
        ``b % num_layers`` (one buffer per layer, or K buffers then V buffers) for the layer-first layouts;
        ``None`` when neither says (layer streaming then refuses the room)."""
        ids = [b.layer_id for b in self.kv]
        if all(i >= 0 for i in ids):
            return ids
        layers = self.num_layers
        if layers > 0 and self.layout in ("layer_first", "mla") and len(self.kv) % layers == 0:
            return [b % layers for b in range(len(self.kv))]
        return None

    @property
    def is_mla(self) -> bool:
        return self.layout == "mla"

    def compat_hash(self) -> str:
        """A digest of what must match between any two peers: the KV dtype.

        Layouts, page sizes, buffer counts and item lengths may differ (conversion, PP stages, TP head
        splits); they are paired and checked per peer at registration.
        """
        parts = [self.dtype]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    def page_geometry(self) -> PageGeometry | str:
        """How this rank pages its KV, for conversion between layouts: needs ``kv_heads`` (and ``num_layers``
        for the page-first layouts); returns the reason when it cannot be told."""
        return page_geometry(self.layout, self.head_order, self.page_size, self.kv_heads,
                             [b.item_len for b in self.kv], self.num_layers)
