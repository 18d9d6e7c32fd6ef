"""Closing a manager whose engine still writes: its control port keeps accepting connections until the writes
are over. A decode takes a refused connection for proof that the prefill's process is gone and releases the
pages it was writing; while this process's engine may still land a write there, that would be a lie."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import numpy as np
import pytest

from aiotransfer import KVArgs, KVManager, TransferConfig, TransferFailed
from aiotransfer._kv.probe import port_refuses
from tests.peer import make_buffers
from tests.remote import RemotePeer

BIG: dict[str, Any] = {"buffers": 4, "pages": 2048, "item_len": 4096}


async def test_a_manager_closed_with_writes_in_flight_keeps_its_port_until_they_are_over(engine: str) -> None:
    decode = await RemotePeer.start(engine, **BIG)
    try:
        bufs = make_buffers(BIG["buffers"], BIG["pages"], BIG["item_len"], seed=3)
        cfg = TransferConfig(engine=engine, staging="never", engine_timeout_s=30)
        mgr = await KVManager(KVArgs(bufs, page_size=16, dtype="uint8"), cfg).start()
        endpoint = mgr.endpoint
        tx = mgr.sender(1)
        await decode.call("receiver", room=1, peer=endpoint, pages=list(range(2000)))
        await tx.wait_ready(timeout=10)
        decode.signal(signal.SIGSTOP)  # the engine cannot finish its writes while the decode is stopped
        send = asyncio.ensure_future(tx.send_kv([int(x) for x in np.random.default_rng(4).permutation(2000)],
                                                timeout=30))
        for _ in range(1000):
            if mgr.stats()["in_flight"] > 0:
                break
            await asyncio.sleep(0.001)
        assert mgr.stats()["in_flight"] > 0

        t0 = time.monotonic()
        await mgr.aclose(timeout=0.3)
        assert time.monotonic() - t0 < 3.0  # the close itself does not wait for the writes
        with pytest.raises(TransferFailed, match="manager closed"):  # the room failed with the close
            await send
        assert not await port_refuses(endpoint)  # the engine may still write: nothing may look gone
        await asyncio.sleep(0.5)
        assert mgr.stats()["in_flight"] > 0 and not await port_refuses(endpoint)

        decode.signal(signal.SIGCONT)  # the writes end; then the engine closes, and the port with it
        for _ in range(300):
            if await port_refuses(endpoint):
                break
            await asyncio.sleep(0.1)
        assert mgr.stats()["in_flight"] == 0
        assert await port_refuses(endpoint)
    finally:
        decode.signal(signal.SIGCONT)
        await decode.close()
