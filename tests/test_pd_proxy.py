"""examples/vllm_pd_proxy.py: what it promises, proven by causality, not by timing.

Against stand-ins that speak vLLM's protocol (real vLLM cannot hold an answer on demand;
tests/vllm/test_vllm_proxy.py runs the proxy in front of real vLLM servers):

- **Streams pass through as they come.** The decode here is a stand-in that speaks vLLM's protocol and holds the rest of its stream until the client
says it has the first event. A proxy that passed the stream on chunk by chunk lets the client say so; one
that waited for the whole answer cannot, and the stand-in gives up holding after ``hold`` seconds. Real vLLM
cannot hold a stream on demand, which is why this is a stand-in (tests/vllm/test_vllm_proxy.py checks the
tokens of a real stream through the proxy). The negative control runs the same check through a relay that
buffers, and sees it fail.
- **Concurrent dispatch** (``--concurrent``): a stand-in prefill holds its answer until the decode's request
  has arrived, which only a router that called both at once lets happen; a serial router fails the same
  check. A prefill call that fails ends the decode call, and the client gets the prefill's error.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from aiohttp import ClientSession, ClientTimeout, web

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 8
KV_PARAMS = {"do_remote_prefill": True, "room": 1}
"""What the stand-in's prefill answers and its decode wants."""


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_pd_proxy", ROOT / "examples" / "vllm_pd_proxy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class HeldDecode:
    """A prefill and a decode in one: the decode streams one event, then holds the rest until
    :attr:`client_has_first` is set or ``hold`` seconds pass."""

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self.client_has_first = asyncio.Event()
        self.held_until_told: bool | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):  # the prefill call
            return web.json_response({"choices": [{"text": "t0"}], "kv_transfer_params": KV_PARAMS})
        assert body["kv_transfer_params"] == KV_PARAMS, body
        sse = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await sse.prepare(request)
        await sse.write(self.event(0))
        try:
            await asyncio.wait_for(self.client_has_first.wait(), self.hold)
            self.held_until_told = True
        except asyncio.TimeoutError:
            self.held_until_told = False
        for i in range(1, TOKENS):
            await sse.write(self.event(i))
        await sse.write(b"data: [DONE]\n\n")
        return sse

    @staticmethod
    def event(i: int) -> bytes:
        return f"data: {json.dumps({'choices': [{'text': f't{i}'}]})}\n\n".encode()


async def buffering_relay(upstream: str, request: web.Request) -> web.Response:
    """The negative control: a relay that answers only once it has the decode's whole stream."""
    body = {**await request.json(), "kv_transfer_params": KV_PARAMS}
    async with ClientSession() as http:
        async with http.post(upstream + "/v1/completions", json=body) as resp:
            return web.Response(body=await resp.read(), content_type="text/event-stream")


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def stream_through(
    make_front: Callable[[str], Awaitable[web.Application]], hold: float
) -> tuple[HeldDecode, list[str]]:
    """Streams a completion through the front ``make_front(upstream)`` builds; sets the stand-in's
    ``client_has_first`` as soon as the first event reaches the client. Returns the stand-in and the texts."""
    decode = HeldDecode(hold)
    upstream_app = web.Application()
    upstream_app.router.add_post("/v1/completions", decode.handle)
    texts: list[str] = []
    async with serving(upstream_app) as upstream, serving(await make_front(upstream)) as front:
        async with ClientSession(timeout=ClientTimeout(total=60)) as http:
            body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": TOKENS, "stream": True}
            async with http.post(front + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                async for line in resp.content:
                    data = line.decode().strip().removeprefix("data: ")
                    if not data or data == "[DONE]":
                        continue
                    texts.append(json.loads(data)["choices"][0]["text"])
                    decode.client_has_first.set()
    return decode, texts


async def the_proxy(upstream: str) -> web.Application:
    return load_example().Proxy([upstream], [upstream], timeout=30).app()


async def the_control(upstream: str) -> web.Application:
    async def relay(request: web.Request) -> web.Response:
        return await buffering_relay(upstream, request)

    app = web.Application()
    app.router.add_post("/v1/completions", relay)
    return app


async def test_the_proxy_passes_the_first_event_on_before_the_decode_sends_the_rest() -> None:
    decode, texts = await stream_through(the_proxy, hold=30.0)
    assert decode.held_until_told is True, (
        "the first event reached the client only after the decode gave up holding"
    )
    assert texts == [f"t{i}" for i in range(TOKENS)]


async def test_negative_control_a_buffering_relay_fails_the_same_check() -> None:
    decode, texts = await stream_through(the_control, hold=0.5)
    assert decode.held_until_told is False
    assert texts == [f"t{i}" for i in range(TOKENS)]


# -- concurrent dispatch ---------------------------------------------------------------------------
ENDPOINT, KEY_ENDPOINT, KEY_ROOM = "tcp://127.0.0.1:7", "aiotransfer_endpoint", "aiotransfer_room"


class Pair:
    """A stand-in prefill and decode. From the second request on, the prefill holds its answer until the
    decode's request for the same prompt has arrived, or ``hold`` seconds pass; with ``fail`` it then
    answers 400, and the decode holds its answer until its connection closes (or 30 s)."""

    def __init__(self, hold: float, fail: bool = False) -> None:
        self.hold, self.fail = hold, fail
        self.prefill_rooms: list[object] = []
        self.decode_params: list[dict[str, object]] = []
        self.held_until_decode: list[bool] = []
        self.decode_closed_early: list[bool] = []

    async def prefill(self, request: web.Request) -> web.Response:
        body = await request.json()
        params = body["kv_transfer_params"]
        assert params["do_remote_decode"] and body["max_tokens"] == 1 and not body["stream"], body
        self.prefill_rooms.append(room := params.get(KEY_ROOM))
        n = len(self.prefill_rooms)
        if n > 1:
            deadline = time.monotonic() + self.hold
            while len(self.decode_params) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            self.held_until_decode.append(len(self.decode_params) >= n)
            if self.fail:
                return web.json_response(
                    {"error": {"message": "prompt too long for this prefill"}}, status=400
                )
        return web.json_response(
            {
                "choices": [{"text": "t0"}],
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    KEY_ENDPOINT: ENDPOINT,
                    KEY_ROOM: 1 if room is None else room,
                    "remote_num_tokens": 3,
                    "remote_block_ids": [5],
                },
            }
        )

    async def decode(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.decode_params.append(body["kv_transfer_params"])
        sse = None
        if body.get("stream"):
            sse = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await sse.prepare(request)
        if self.fail and len(self.decode_params) > 1:
            deadline = time.monotonic() + 30
            while request.transport is not None and not request.transport.is_closing():
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.01)
            self.decode_closed_early.append(request.transport is None or request.transport.is_closing())
            return sse or web.Response(status=500)
        if sse is not None:
            await sse.write(HeldDecode.event(0) + b"data: [DONE]\n\n")
            return sse
        return web.json_response({"choices": [{"text": "t0 t1"}]})


async def dispatch(
    concurrent: bool, pair: Pair, bodies: list[dict[str, object]]
) -> tuple[list[tuple[int, str]], Any]:
    prefill_app, decode_app = web.Application(), web.Application()
    prefill_app.router.add_post("/v1/completions", pair.prefill)
    decode_app.router.add_post("/v1/completions", pair.decode)
    answers: list[tuple[int, str]] = []
    async with serving(prefill_app) as prefill, serving(decode_app) as decode:
        proxy = load_example().Proxy([prefill], [decode], timeout=30, concurrent=concurrent)
        async with serving(proxy.app()) as front, ClientSession(timeout=ClientTimeout(total=60)) as http:
            for body in bodies:
                async with http.post(front + "/v1/completions", json=body) as resp:
                    answers.append((resp.status, await resp.text()))
    return answers, proxy


BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}


async def test_concurrent_dispatch_asks_the_decode_before_the_prefill_answers() -> None:
    pair = Pair(hold=30.0)
    answers, proxy = await dispatch(True, pair, [BODY, BODY])
    assert [status for status, _ in answers] == [200, 200], answers
    # The first request learns the prefill worker's address (in turn); the second goes to both at once.
    assert proxy.dispatched == {"serial": 1, "concurrent": 1}
    assert pair.held_until_decode == [True], "the prefill answered before the decode's request arrived"
    room = pair.prefill_rooms[1]
    assert isinstance(room, int) and 0 <= room < 2**63
    assert pair.decode_params[1] == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        KEY_ENDPOINT: ENDPOINT,
        KEY_ROOM: room,
    }


async def test_negative_control_a_serial_router_fails_the_same_check() -> None:
    pair = Pair(hold=0.5)
    answers, proxy = await dispatch(False, pair, [BODY, BODY])
    assert [status for status, _ in answers] == [200, 200], answers
    assert proxy.dispatched == {"serial": 2, "concurrent": 0}
    assert pair.held_until_decode == [False]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failed_prefill_ends_the_concurrent_decode_with_its_error(stream: bool) -> None:
    pair = Pair(hold=30.0, fail=True)
    answers, proxy = await dispatch(True, pair, [BODY, {**BODY, "stream": stream}])
    assert proxy.dispatched == {"serial": 1, "concurrent": 1}
    status, text = answers[1]
    assert "prompt too long for this prefill" in text, answers[1]
    assert status == (200 if stream else 400)  # a stream's status line is out before the prefill fails
    assert pair.decode_closed_early == [True], "the decode call was not ended"
