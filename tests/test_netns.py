"""Two simulated hosts (network namespaces joined by a veth pair); the link is cut mid-transfer.

Needs root and iproute2; all traffic stays inside namespaces this test creates and removes.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.remote import RemoteError, RemotePeer

NS_A, NS_B = "aiot-a", "aiot-b"
IP_A, IP_B = "10.231.0.1", "10.231.0.2"
GEO = {"buffers": 4, "pages": 2048, "item_len": 4096}
BOUND = 5.0

pytestmark = pytest.mark.netns


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _teardown() -> None:
    for ns in (NS_A, NS_B):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def hosts() -> Iterator[None]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    _teardown()
    try:
        _ip("netns", "add", NS_A)
        _ip("netns", "add", NS_B)
        _ip("link", "add", "aiot-va", "type", "veth", "peer", "name", "aiot-vb")
        _ip("link", "set", "aiot-va", "netns", NS_A)
        _ip("link", "set", "aiot-vb", "netns", NS_B)
        for ns, dev, addr in ((NS_A, "aiot-va", IP_A), (NS_B, "aiot-vb", IP_B)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        _teardown()
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode().strip()}")
    yield
    _teardown()


async def test_link_cut_mid_transfer_fails_both_sides(hosts: None) -> None:
    env_a = {"AIOTRANSFER_HOSTNAME": IP_A, "AIOTRANSFER_STAGING": "never"}
    env_b = {"AIOTRANSFER_HOSTNAME": IP_B}
    prefill = await RemotePeer.start("mooncake_tcp", env=env_a, prefix=["ip", "netns", "exec", NS_A], seed=1, **GEO)
    decode = await RemotePeer.start("mooncake_tcp", env=env_b, prefix=["ip", "netns", "exec", NS_B], **GEO)
    try:
        # a healthy room across the two hosts first
        await prefill.call("sender", room=1)
        await decode.call("receiver", room=1, peer=prefill.endpoint, pages=[1, 2, 3])
        await prefill.call("wait_ready", room=1)
        await prefill.call("send_kv", room=1, pages=[4, 5, 6])
        assert (await decode.call("done", room=1))["status"] == "Success"
        # now a long transfer, and the link goes down under it
        pages = list(range(0, 2000))
        await prefill.call("sender", room=2)
        await decode.call("receiver", room=2, peer=prefill.endpoint, pages=pages[::-1])
        await prefill.call("wait_ready", room=2)
        send = asyncio.ensure_future(prefill.call("send_kv", room=2, pages=pages, timeout=60))
        done = asyncio.ensure_future(decode.call("done", room=2, timeout=60))
        await asyncio.sleep(0.05)
        _ip("-n", NS_A, "link", "set", "aiot-va", "down")
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as tx_err:
            await send
        t_tx = time.monotonic() - t0
        with pytest.raises(RemoteError) as rx_err:
            await done
        t_rx = time.monotonic() - t0
        assert tx_err.value.error == "TransferFailed", tx_err.value.reason
        assert rx_err.value.error == "TransferFailed", rx_err.value.reason
        assert "silent for" in rx_err.value.reason
        assert t_tx < BOUND and t_rx < BOUND, (t_tx, t_rx)
        print(f"link cut detected: prefill {t_tx:.2f}s ({tx_err.value.reason}); decode {t_rx:.2f}s")
    finally:
        await prefill.close()
        await decode.close()
