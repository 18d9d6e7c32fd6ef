"""Control messages are bounded while they are decoded, not after.

Every string, bytes, list and map field of every message carries a length bound that the decoder checks on the
field's length prefix, before it decodes any item: refusing an oversized message costs time and memory in
proportion to the bounds, not to what the peer sent. The bounds and the default whole-message bound
(``max_message_bytes``) are sized from the largest legitimate message; the tests below hold them to both.

Peak memory is read from the kernel (``VmHWM``, reset before each measurement): it counts whatever the decoder
allocates, Python objects or not.
"""

from __future__ import annotations

import contextlib
import gc
import struct
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import msgspec.inspect as mi
import numpy as np
import pytest

from aiotransfer import InvalidArgument, KVArgs, KVManager, TransferConfig
from aiotransfer._control import messages as m
from aiotransfer._control.endpoint import ControlPlane
from aiotransfer.errors import ProtocolError
from tests.peer import make_buffers
from tests.zmqtools import peak_rss_mib, reset_peak_rss

MiB = 1 << 20
DEFAULT_BOUND = TransferConfig().max_message_bytes
REFUSAL_S, REFUSAL_MIB = 0.1, 8.0
"""A refusal of an oversized message takes well under this (measured: ~0.1 ms and nothing allocated)."""

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for peak memory")


# -- every field is bounded, and every bound holds ---------------------------------------------------------

Build = Callable[[Any], m.Message]


def _zero(t: mi.Type) -> Any:
    """The smallest value of a type: only the type layer looks at these, never :func:`m.validate`."""
    if isinstance(t, mi.UnionType):
        return None if any(isinstance(x, mi.NoneType) for x in t.types) else _zero(t.types[0])
    if isinstance(t, mi.StructType):
        return t.cls(**{f.name: _zero(f.type) for f in t.fields})
    if isinstance(t, mi.IntType):
        return max(0, t.ge or 0)
    zeros: dict[type, Any] = {mi.IntType: 0, mi.BoolType: False, mi.FloatType: 0.0, mi.StrType: "",
                              mi.BytesType: b"", mi.ListType: [], mi.DictType: {}}
    return zeros[type(t)]


def _filled(t: mi.Type, n: int) -> Any:
    """A value of type ``t`` of length ``n``."""
    if isinstance(t, mi.StrType):
        return "a" * n
    if isinstance(t, mi.BytesType):
        return b"\x00" * n
    if isinstance(t, mi.ListType):
        return [_zero(t.item_type)] * n
    assert isinstance(t, mi.DictType)
    return {str(i): _zero(t.value_type) for i in range(n)}


def _walk(t: mi.Type, path: str, wrap: Build) -> Iterator[tuple[str, mi.Type, Build]]:
    """``(path, type, build)`` for type ``t`` and every type reachable from it: ``build(v)`` is a whole message
    whose value at ``path`` is ``v``; ``wrap`` puts a value of type ``t`` in one."""
    yield path, t, wrap
    if isinstance(t, mi.ListType):
        yield from _walk(t.item_type, f"{path}[]", lambda v: wrap([v]))
    elif isinstance(t, mi.DictType):
        yield from _walk(t.key_type, f"{path}{{key}}", lambda k: wrap({k: _zero(t.value_type)}))
        yield from _walk(t.value_type, f"{path}{{}}", lambda v: wrap({"k": v}))
    elif isinstance(t, mi.StructType):
        base = _zero(t)

        def setter(name: str) -> Build:
            return lambda v: wrap(msgspec.structs.replace(base, **{name: v}))

        for f in t.fields:
            yield from _walk(f.type, f"{path}.{f.name}", setter(f.name))
    elif isinstance(t, mi.UnionType):
        for x in t.types:
            yield from _walk(x, path, wrap)


def _bounded(t: mi.Type, path: str, wrap: Build) -> Iterator[tuple[str, int | None, Callable[[int], m.Message]]]:
    """``(path, max_length, build)`` for every value with a length reachable from type ``t``: ``build(n)`` is a
    whole message whose value at ``path`` has length ``n``."""
    def sized(x: mi.Type, build: Build) -> Callable[[int], m.Message]:
        return lambda n: build(_filled(x, n))

    for where, x, build in _walk(t, path, wrap):
        if isinstance(x, (mi.StrType, mi.BytesType, mi.ListType, mi.DictType)):
            yield where, x.max_length, sized(x, build)


def _fields() -> list[tuple[str, int | None, Callable[[int], m.Message]]]:
    union = mi.type_info(m.Message)
    assert isinstance(union, mi.UnionType)
    out = []
    for s in union.types:
        assert isinstance(s, mi.StructType)
        out += list(_bounded(s, s.cls.__name__, lambda v: v))
    return out


FIELDS = _fields()


def test_every_string_bytes_list_and_map_of_every_message_has_a_length_bound() -> None:
    unbounded = [path for path, bound, _ in FIELDS if bound is None]
    assert not unbounded, f"fields without a length bound (Annotated[..., msgspec.Meta(max_length=...)]): {unbounded}"
    assert len(FIELDS) > 40
    before = list(_bounded(mi.type_info(_UnboundedRequest), "old", lambda v: v))  # the negative control
    assert [(path, bound) for path, bound, _ in before] == [("old.state_indices", None), ("old.state_indices{key}", None),
                                                            ("old.state_indices{}", None)]


@pytest.mark.parametrize(("path", "bound", "build"), [f for f in FIELDS if f[1] is not None],
                         ids=[f[0] for f in FIELDS if f[1] is not None])
def test_each_bound_takes_its_largest_value_and_refuses_one_more(
        path: str, bound: int, build: Callable[[int], m.Message]) -> None:
    raw = msgspec.msgpack.encode  # what a peer may send: no clipping on the way
    msgspec.msgpack.decode(raw(build(bound)), type=m.Message)  # the type layer takes it
    with pytest.raises(ProtocolError, match="undecodable control message") as refused:
        m.decode(raw(build(bound + 1)))
    assert f"length <= {bound}" in str(refused.value)


# -- every integer has a range --------------------------------------------------------------------------------

def _integers(t: mi.Type, path: str, wrap: Build) -> Iterator[tuple[str, mi.IntType, Build]]:
    """``(path, type, build)`` for every integer reachable from type ``t``."""
    for where, x, build in _walk(t, path, wrap):
        if isinstance(x, mi.IntType):
            yield where, x, build


def _all_integers(message: Any) -> list[tuple[str, mi.IntType, Build]]:
    union = mi.type_info(message)
    assert isinstance(union, mi.UnionType)
    return [i for s in union.types if isinstance(s, mi.StructType) for i in _integers(s, s.cls.__name__, lambda v: v)]


INTEGERS = _all_integers(m.Message)
CHECKED_WHERE_READ = {
    "Status.slices[]": "a Success whose checksum geometry does not fit fails its room at once (test_checksums)",
}
"""Integers the decoder takes whole, on purpose: each is checked where it is read, with the room's failure as
the answer, which a dropped message would not give."""


def test_every_integer_of_every_message_has_a_range() -> None:
    """Sizes, offsets, indices, counts, ids: a peer's integer means something only within its range, and the
    decoder holds it there before any handler reads it."""
    unranged = [path for path, t, _ in INTEGERS if t.ge is None and t.gt is None]
    assert unranged == list(CHECKED_WHERE_READ), (
        f"integers without a lower bound (Annotated[int, msgspec.Meta(ge=...)]): {unranged}")
    assert len(INTEGERS) > 80
    # the negative control: the staging request as it was declared before its fields had ranges
    before = _all_integers(_UnrangedStageRequest | m.Ping)
    assert [path for path, t, _ in before if t.ge is None] == ["_UnrangedStageRequest.req_id",
                                                               "_UnrangedStageRequest.nbytes"]


@pytest.mark.parametrize(("path", "t", "build"), [i for i in INTEGERS if i[1].ge is not None],
                         ids=[i[0] for i in INTEGERS if i[1].ge is not None])
def test_each_integer_takes_its_range_and_refuses_one_below_and_above(path: str, t: mi.IntType, build: Build) -> None:
    raw = msgspec.msgpack.encode
    assert t.ge is not None
    msgspec.msgpack.decode(raw(build(t.ge)), type=m.Message)
    with pytest.raises(ProtocolError, match="undecodable control message"):
        m.decode(raw(build(t.ge - 1)))
    top = t.le if t.le is not None else None if t.lt is None else t.lt - 1
    if top is not None:
        msgspec.msgpack.decode(raw(build(top)), type=m.Message)
        with pytest.raises(ProtocolError, match="undecodable control message"):
            m.decode(raw(build(top + 1)))


class _UnrangedStageRequest(msgspec.Struct, tag="stage_req"):
    req_id: int
    nbytes: int


def test_a_long_reason_is_cut_when_sent_not_refused_when_received() -> None:
    """Refusals explain themselves at any length (a registration refused for its item lengths lists them):
    ``encode`` cuts a reason to the bound, so the peer reads the explanation instead of dropping it."""
    long = "item lengths differ: " + "x" * 10_000
    for msg in (m.HelloAck(version=m.PROTOCOL_VERSION, endpoint="e", generation=1, accepted=False, reason=long),
                m.Abort(room=1, endpoint="e", reason=long)):
        got = m.decode(m.encode(msg))
        assert isinstance(got, (m.HelloAck, m.Abort)) and got.reason == long[:m.MAX_REASON]
        with pytest.raises(ProtocolError, match=f"length <= {m.MAX_REASON}"):
            m.decode(msgspec.msgpack.encode(msg))


# -- oversized messages: refused on their length prefix ----------------------------------------------------

def _with_array(msg: m.Message, marker: bytes, n: int, item: bytes) -> bytes:
    """``msg`` encoded, its empty array right after ``marker`` replaced by ``n`` copies of ``item``: the
    bytes a peer sends without ever building the list."""
    data = m.encode(msg)
    at = data.index(marker) + len(marker)
    assert data[at] == 0x90  # an empty fixarray
    return data[:at] + b"\xdd" + struct.pack(">I", n) + item * n + data[at + 1:]


def _request_of_state_indices(n: int) -> bytes:
    req = m.TransferRequest(room=1, endpoint="tcp://127.0.0.1:1", generation=1, kv_indices=b"",
                            state_indices={"swa": []})
    return _with_array(req, msgspec.msgpack.encode("swa"), n, b"\x07")


def _hello_of_buffers(n: int) -> bytes:
    hello = m.Hello(version=m.PROTOCOL_VERSION, endpoint="tcp://127.0.0.1:1", generation=1, engine="mooncake",
                    session_id="s", engine_info=b"", probe_addr=1, compat="c", kv=[])
    return _with_array(hello, msgspec.msgpack.encode("kv"), n, msgspec.msgpack.encode(m.BufferSpec(1, 1, 1)))


class _UnboundedSpec(msgspec.Struct, array_like=True):
    ptr: int
    nbytes: int
    item_len: int
    layer_id: int = -1


class _UnboundedHello(msgspec.Struct, tag="hello"):
    """The negative control: ``Hello.kv`` as it was declared before it was bounded (other fields skipped)."""

    kv: list[_UnboundedSpec] = []


class _UnboundedRequest(msgspec.Struct, tag="req"):
    """The negative control: ``TransferRequest.state_indices`` as it was declared before it was bounded."""

    state_indices: dict[str, list[int]] = {}


def _cost(decode: Callable[[bytes], Any], data: bytes) -> tuple[float, float]:
    """Seconds, and growth of this process's peak resident memory (MiB), of ``decode(data)``, refused or not."""
    gc.collect()
    reset_peak_rss()
    base, t0, out = peak_rss_mib(), time.perf_counter(), None
    with contextlib.suppress(ProtocolError, msgspec.ValidationError):
        out = decode(data)
    seconds, grown = time.perf_counter() - t0, peak_rss_mib() - base
    del out
    return seconds, grown


ISSUE = {
    "request of 60 M state indices": (lambda: _request_of_state_indices(60_000_000), _UnboundedRequest),
    "hello of 8 M buffer specs": (lambda: _hello_of_buffers(8_000_000), _UnboundedHello),
}


@linux_only
@pytest.mark.parametrize("case", list(ISSUE))
def test_the_issue_messages_are_refused_before_they_are_decoded(case: str) -> None:
    """Both fit the former 64 MiB whole-message bound, and took 1-2 s and 400-550 MiB to decode before a
    value check refused them. Now the decoder refuses each on its length prefix. The negative control decodes
    the same bytes with the field as it was declared before: the assertion on the bounded decoder fails there."""
    make, unbounded = ISSUE[case]
    data = make()
    assert 32 * MiB < len(data) < 64 * MiB
    seconds, grown = _cost(m.decode, data)
    with pytest.raises(ProtocolError, match="undecodable control message"):
        m.decode(data)
    old_seconds, old_grown = _cost(lambda d: msgspec.msgpack.decode(d, type=unbounded), data)
    print(f"{case} ({len(data) / MiB:.0f} MiB): refused in {seconds * 1e3:.2f} ms, +{grown:.1f} MiB; "
          f"unbounded field: {old_seconds:.2f} s, +{old_grown:.0f} MiB")
    assert seconds < REFUSAL_S and grown < REFUSAL_MIB
    assert not (old_seconds < REFUSAL_S and old_grown < REFUSAL_MIB) and old_grown > 100


@pytest.mark.parametrize("case", list(ISSUE))
def test_the_default_whole_message_bound_refuses_them_before_decoding(case: str) -> None:
    plane = ControlPlane("127.0.0.1", 0, lambda _: None, max_sockets=4, max_message_bytes=DEFAULT_BOUND)
    with pytest.raises(ProtocolError, match="message too large"):
        plane.parse([ISSUE[case][0]()])


# -- the default whole-message bound holds the largest legitimate messages ---------------------------------

def _ints(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def _largest_legitimate() -> dict[str, m.Message]:
    big = 1 << 40  # addresses and sizes take 9 bytes each in msgpack
    specs = [m.BufferSpec(big + i * big, big - 1, 1 << 30, 1 << 20) for i in range(m.MAX_BUFFERS)]
    endpoint = "tcp://" + "h" * (m.MAX_ENDPOINT - 12) + ":65535"
    return {
        "request": m.TransferRequest(
            room=(1 << 63) - 1, endpoint=endpoint, generation=1 << 62,
            kv_indices=m.pack_indices(np.arange(2**31 - m.MAX_ROOM_PAGES, 2**31)),
            state_indices={"swa": _ints(1 << 30, m.MAX_ROOM_PAGES), "nsa": _ints(1 << 30, m.MAX_ROOM_PAGES),
                           "mamba": [2**31 - 1]}),
        "hello": m.Hello(
            version=m.PROTOCOL_VERSION, endpoint=endpoint, generation=1 << 62, engine="e" * m.MAX_NAME,
            session_id="s" * m.MAX_ID, engine_info=b"\xff" * m.MAX_ENGINE_INFO, probe_addr=big, compat="c" * m.MAX_ID,
            kv=specs, aux=specs,
            state=[m.StateSpec(f"{i}" * m.MAX_NAME, specs, [1 << 30] * m.MAX_DIMS) for i in range(m.MAX_STATE_KINDS)],
            staging=specs[0], dtype="d" * m.MAX_NAME, kv_device="v" * m.MAX_NAME, head_order="o" * m.MAX_NAME),
        "aux": m.AuxData(room=1, buffer=1 << 30, index=1 << 30, data=b"\xff" * m.MAX_AUX_BYTES, endpoint=endpoint),
        "topology": m.Topology(version=m.PROTOCOL_VERSION, nonce=1 << 62, ready=True, reason="r" * m.MAX_REASON,
                               ranks=[m.RankEndpoint(4095, m.MAX_RANKS - 1, m.MAX_RANKS - 1, m.MAX_RANKS - 1, endpoint)] * m.MAX_RANKS,
                               redirect=endpoint),
        "status": m.Status(room=1, status=4, rank=m.MAX_RANKS - 1, endpoint=endpoint, reason="r" * m.MAX_REASON,
                           aux_path="a" * m.MAX_NAME, checksum=2**32 - 1, slices=[1 << 30] * (6 * m.MAX_BUFFERS)),
    }


def test_the_largest_legitimate_messages_fit_the_default_bound_and_decode() -> None:
    sizes = {}
    for name, msg in _largest_legitimate().items():
        data = m.encode(msg)
        sizes[name] = round(len(data) / MiB, 2)
        assert m.decode(data) == msg
    print(f"largest legitimate messages (MiB): {sizes}; default bound {DEFAULT_BOUND / MiB:.0f} MiB")
    assert max(sizes.values()) * MiB <= DEFAULT_BOUND
    assert sizes["request"] * MiB > DEFAULT_BOUND / 2  # the bound is not far above what is needed


@linux_only
def test_the_costliest_message_within_the_default_bounds() -> None:
    """What one message can still cost to decode: every state kind at its bound, indices of 3 bytes each
    (each a Python int of its own). It fits the whole-message bound and is refused only by value checks."""
    three_bytes = [256 + i % (65536 - 256) for i in range(m.MAX_ROOM_PAGES)]
    kinds = {f"k{i}": three_bytes for i in range(m.MAX_STATE_KINDS)}
    data = m.encode(m.TransferRequest(room=1, endpoint="e", generation=1, kv_indices=b"", state_indices=kinds))
    del kinds, three_bytes
    assert len(data) <= DEFAULT_BOUND
    seconds, grown = _cost(m.decode, data)
    print(f"costliest within bounds ({len(data) / MiB:.1f} MiB): {seconds:.2f} s, +{grown:.0f} MiB")
    assert seconds < 2.0 and grown < 256


# -- a local rank cannot ask for what a peer refuses -------------------------------------------------------

def test_registrations_over_the_bounds_are_refused_locally() -> None:
    with pytest.raises(InvalidArgument, match=f"at most {m.MAX_BUFFERS} buffers"):
        KVArgs(make_buffers(m.MAX_BUFFERS + 1, 1, 16, seed=None), page_size=1)
    kinds = {f"k{i}": make_buffers(1, 4, 16, seed=None) for i in range(m.MAX_STATE_KINDS + 1)}
    with pytest.raises(InvalidArgument, match="state kinds"):
        KVArgs(make_buffers(1, 4, 16, seed=None), page_size=1, state_buffers=kinds)


async def test_a_room_over_the_page_bound_is_refused_before_anything_is_sent() -> None:
    bufs = make_buffers(1, m.MAX_ROOM_PAGES + 1, 1, seed=None)
    async with KVManager(KVArgs(bufs, page_size=1), TransferConfig(engine="mooncake_tcp")) as mgr:
        rx = mgr.receiver(1, "127.0.0.1:9")
        with pytest.raises(InvalidArgument, match=f"at most {m.MAX_ROOM_PAGES} pages"):
            await rx.send_metadata(np.arange(m.MAX_ROOM_PAGES + 1), timeout=5)
        assert mgr.stats()["control_sent"] == 0
