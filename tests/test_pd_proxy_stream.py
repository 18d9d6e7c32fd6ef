"""examples/vllm_pd_proxy.py passes a decode's stream on as it comes, proven by causality, not by timing.

The decode here is a stand-in that speaks vLLM's protocol and holds the rest of its stream until the client
says it has the first event. A proxy that passed the stream on chunk by chunk lets the client say so; one
that waited for the whole answer cannot, and the stand-in gives up holding after ``hold`` seconds. Real vLLM
cannot hold a stream on demand, which is why this is a stand-in (tests/vllm/test_vllm_proxy.py checks the
tokens of a real stream through the proxy). The negative control runs the same check through a relay that
buffers, and sees it fail.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType

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
