"""The release quarantine of engine handles (:mod:`aiotransfer._expiry`): past it, a handle is abandoned, and
memory the engine may still read is given back only once the engine let go of it.

The real engines are in tests/test_frozen_decode.py; here an engine whose ``abandon`` cuts without ending
(Mooncake over TCP: the entries end a moment later, or over several cuts) or cannot end anything (NIXL's
writes in progress) leaves the handle PENDING."""

from __future__ import annotations

import asyncio
import logging

import pytest

from aiotransfer import _expiry
from aiotransfer._driver import Driver
from aiotransfer.engines._base import EngineStatus, TransferHandle
from aiotransfer.errors import EngineError
from tests.test_poller import DoomingEngine, _counted_hold, _held_poller, _one_entry, _until


class CuttingEngine(DoomingEngine):
    """``abandon`` leaves the handle PENDING: the engine ends it only when the test says so."""

    def abandon(self, handle: TransferHandle) -> None:
        self.abandoned.append(handle)


async def test_a_handle_the_engine_does_not_let_go_of_keeps_its_memory_until_it_ends(
        caplog: pytest.LogCaptureFixture) -> None:
    engine, driver = CuttingEngine(), Driver("expiry-test")
    poller = _held_poller(engine, driver, expire_after=0.05)
    held = [0]
    try:
        with pytest.raises(EngineError):
            await asyncio.wait_for(poller.write("peer", _one_entry(4096), timeout=5, hold=_counted_hold(held)), 5)
        with caplog.at_level(logging.WARNING, logger="aiotransfer.poller"):
            await _until(lambda: len(engine.abandoned) >= 2, 3 * _expiry.RECUT_S + 1)
        # abandoned, and again while it runs: its memory is held all along
        assert (held[0], poller.in_flight, poller.expired, poller.held) == (1, 1, 1, 1)
        assert len(engine.abandoned) >= 2 and set(engine.abandoned) == {engine.abandoned[0]}
        assert "still not ended" in caplog.text and "after it was abandoned" in caplog.text
        engine.released, engine.outcome = True, EngineStatus.FAILED  # the cut took: the engine ends the write
        await _until(lambda: not poller.in_flight)
        assert (held[0], poller.in_flight, poller.expired, poller.held, poller.overdue) == (0, 0, 1, 0, 0)
    finally:
        await poller.aclose(1.0)
        driver.close()


async def test_a_handle_the_engine_lets_go_of_ends_with_the_abandon() -> None:
    """The adapter consumed the handle (the default ``abandon``): it ends at once, abandoned once."""
    engine, driver = DoomingEngine(), Driver("expiry-test")
    poller = _held_poller(engine, driver, expire_after=0.05)
    held = [0]
    try:
        with pytest.raises(EngineError):
            await asyncio.wait_for(poller.write("peer", _one_entry(4096), timeout=5, hold=_counted_hold(held)), 5)
        await _until(lambda: not poller.in_flight)
        await asyncio.sleep(2 * _expiry.RECUT_S)
        assert (held[0], poller.expired, poller.held, len(engine.abandoned)) == (0, 1, 0, 1)
    finally:
        await poller.aclose(1.0)
        driver.close()


def test_cut_connections_shuts_down_only_the_sockets_to_that_address() -> None:
    """What Mooncake's ``abandon`` cuts: every TCP connection of this process to one address, and no other;
    the sockets stay open (their numbers are the engine's), a blocked send on them fails."""
    import socket

    from aiotransfer.engines._mooncake_cut import cut_connections

    servers = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    target, other = (s.getsockname()[1] for s in servers)
    clients = [socket.create_connection(("127.0.0.1", port)) for port in (target, target, other)]
    try:
        assert cut_connections("127.0.0.1", target) == 2
        for sock in clients[:2]:
            with pytest.raises(OSError):
                sock.sendall(b"x" * (1 << 20))
            assert sock.fileno() >= 0
        clients[2].sendall(b"x")  # the connection to another address is untouched
    finally:
        for sock in clients + servers:
            sock.close()
