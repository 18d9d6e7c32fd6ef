from __future__ import annotations

import importlib.util
import os
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from aiotransfer import KVArgs, KVManager, TransferConfig
from tests.peer import digest, make_buffers
from tests.remote import RemotePeer


def nixl_available() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("nixl_cu12", "nixl_cu13", "nixl"))


ENGINES = [
    "mooncake_tcp",
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl not installed")),
]

GEOMETRY: dict[str, Any] = {"buffers": 4, "pages": 256, "item_len": 4096}


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def src_buffers() -> list[np.ndarray]:
    return make_buffers(GEOMETRY["buffers"], GEOMETRY["pages"], GEOMETRY["item_len"], seed=1234)


@pytest.fixture
async def prefill(engine: str, src_buffers: list[np.ndarray]) -> AsyncIterator[KVManager]:
    cfg = TransferConfig(engine=engine, handshake_timeout=10.0)
    async with KVManager(KVArgs(src_buffers, page_size=16, dtype="uint8"), cfg) as mgr:
        yield mgr


@pytest.fixture
async def decode(engine: str) -> AsyncIterator[RemotePeer]:
    peer = await RemotePeer.start(engine, **GEOMETRY)
    try:
        yield peer
    finally:
        await peer.close()


def expected_digest(bufs: Any, pages: list[int]) -> str:
    return digest(bufs, pages)
