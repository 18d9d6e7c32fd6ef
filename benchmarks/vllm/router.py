"""``python -m benchmarks.vllm_pd router``: TTFT through ``examples/vllm_pd_proxy.py`` in front of real
vLLM OpenAI servers, serial dispatch against ``--concurrent``, and against the decode server alone.

What a client of a PD deployment waits for: a prefill and a decode ``api_server`` (unmodified vLLM, the
:data:`~benchmarks.vllm.model.BENCH` model, AiotransferConnector over ``--engine``), each process
group on its own core (as on its own host), behind two routers over the same servers, one serial, one
``--concurrent``. Per round and prompt size, fresh random prompts (no prefix-cache hit anywhere) go, streamed,
through each router and to the decode server alone (the single engine: the same machine's TTFT without
disaggregation), in a new random order every round; TTFT is the client's time from sending the request to
the first event that carries a token. The exposed handover is a router's TTFT minus the single engine's
(p50 of the same round set).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiotransfer._cli import console
from aiotransfer._cli.files import write_json

from .. import ROOT
from .model import BENCH, make_tiny_llama
from .spec import free_port

__all__ = ["run_router_bench"]

MODEL = "bench"
MODES = ("single", "serial", "concurrent")


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except OSError:
        return 0


@contextlib.contextmanager
def _process(cmd: list[str], log: str, env: dict[str, str], cpu: int | None) -> Iterator[subprocess.Popen[bytes]]:
    """A process in its own session (killed as a group), on core ``cpu`` if given, logging to ``log``."""
    pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=pin)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait(10)


def _ttft(url: str, prompt: list[int], max_tokens: int, salt: str | None, timeout: float = 600.0) -> float:
    """Seconds from sending a streamed completion to the first event carrying a token."""
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": True, "return_token_ids": True}
    if salt is not None:
        body["cache_salt"] = salt
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    first = None
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if first is None and line.startswith("data: {"):
                if any(c.get("token_ids") for c in json.loads(line[6:]).get("choices", [])):
                    first = time.monotonic() - t0
    if first is None:
        raise RuntimeError(f"{url}: no token came")
    return first


def run_router_bench(ns: argparse.Namespace, workdir: str) -> int:
    t0 = time.monotonic()
    sizes = [256] if ns.quick else [int(t) for t in str(ns.tokens).split(",") if t]
    concs = [1, 4] if ns.quick else [int(c) for c in ns.concurrency.split(",") if c]
    repeats = ns.repeats if ns.repeats is not None else (1 if ns.quick else 3)
    longest = max(sizes)
    block = ns.block_size
    max_len = longest + ns.max_tokens + block
    spec = dataclasses.replace(BENCH, max_position_embeddings=max(2048, max_len))
    need = max(concs) * -(-(longest + ns.max_tokens) // block) * spec.block_bytes(block)
    kv_bytes = max(128 << 20, (need * 2 + (1 << 20) - 1) // (1 << 20) << 20)
    model = make_tiny_llama(os.path.join(workdir, "router-model"), seed=ns.model_seed, spec=spec)
    engine = ns.engine
    res: dict[str, Any] = {"suite": "vllm-router", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "engine": engine, "tokens": sizes, "concurrency": concs, "repeats": repeats,
                           "max_tokens": ns.max_tokens, "block_size": block, "model": dataclasses.asdict(spec),
                           "ttft_s": {}, "summary": {}}
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env.update(VLLM_HOST_IP="127.0.0.1", UCX_NET_DEVICES="lo", MC_LOG_LEVEL="WARNING", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONPATH=ROOT)
    ports = {name: free_port() for name in ("prefill", "decode", "serial", "concurrent")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    servers: dict[str, subprocess.Popen[bytes]] = {}
    with contextlib.ExitStack() as stack:
        for cpu, (name, role) in enumerate((("prefill", "kv_producer"), ("decode", "kv_consumer"))):
            ktc = {"kv_connector": "AiotransferConnector", "kv_connector_module_path": "aiotransfer.integrations.vllm",
                   "kv_role": role, "kv_connector_extra_config": {"engine": engine, "transfer_timeout": 300.0,
                                                                  "lease": 300.0}}
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                   "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(ports[name]),
                   "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32", "--max-model-len",
                   str(max_len), "--block-size", str(block), "--kv-cache-memory-bytes",
                   str(kv_bytes), "--kv-transfer-config", json.dumps(ktc)]
            servers[name] = stack.enter_context(_process(cmd, os.path.join(workdir, f"{name}.log"),
                                                         {**env, "VLLM_CPU_OMP_THREADS_BIND": str(cpu)}, cpu))
        for mode in ("serial", "concurrent"):
            cmd = [sys.executable, os.path.join(ROOT, "examples", "vllm_pd_proxy.py"), "--port", str(ports[mode]),
                   "--prefill", urls["prefill"], "--decode", urls["decode"], "--timeout", "600"]
            stack.enter_context(_process(cmd + (["--concurrent"] if mode == "concurrent" else []),
                                         os.path.join(workdir, f"{mode}.log"), env, None))
        deadline = time.monotonic() + 600
        for name, path in (("prefill", "/health"), ("decode", "/health"), ("serial", "/healthz"),
                           ("concurrent", "/healthz")):
            while _get(urls[name] + path) != 200:
                if time.monotonic() > deadline or any(p.poll() is not None for p in servers.values()):
                    raise RuntimeError(f"{name} not ready (or a server exited); logs in {workdir}")
                time.sleep(0.5)
        res["ready_s"] = time.monotonic() - t0
        rng = random.Random(ns.seed)
        target = {"single": urls["decode"], "serial": urls["serial"], "concurrent": urls["concurrent"]}
        for mode in MODES:  # warm-up; the concurrent router learns the prefill worker's address
            _ttft(target[mode], [rng.randrange(3, 1024) for _ in range(64)], 2, "warm" if mode == "single" else None)
        for size in sizes:
            for conc in concs:
                key = f"{size}x{conc}"
                got: dict[str, list[float]] = {m: [] for m in MODES}
                for r in range(repeats):
                    for mode in rng.sample(MODES, len(MODES)):
                        prompts = [[rng.randrange(3, 1024) for _ in range(size)] for _ in range(conc)]
                        salt = f"single-{key}-{r}" if mode == "single" else None
                        with ThreadPoolExecutor(conc) as pool:
                            futures = [pool.submit(_ttft, target[mode], p, ns.max_tokens, salt) for p in prompts]
                            got[mode] += [f.result() for f in futures]
                res["ttft_s"][key] = got
                single = statistics.median(got["single"])
                res["summary"][key] = {m: {"ttft_p50_s": statistics.median(xs), "ttft_max_s": max(xs),
                                           "handover_p50_s": statistics.median(xs) - single}
                                       for m, xs in got.items()}
                print(f"[router bench] {key}: " + ", ".join(
                    f"{m} {s['ttft_p50_s'] * 1e3:.0f} ms" for m, s in res["summary"][key].items()), file=sys.stderr)
        with urllib.request.urlopen(urls["concurrent"] + "/healthz", timeout=10) as resp:
            res["dispatched"] = json.loads(resp.read())["dispatched"]
    res["wall_s"] = time.monotonic() - t0
    lines = [f"TTFT through the router ({engine}; prompts {sizes}, {ns.max_tokens} decode tokens; p50 over "
             f"{repeats} round(s), ms; handover = TTFT - the decode server alone)",
             "| prompt x in flight | single engine | serial | serial handover | concurrent | concurrent handover |",
             "|---|---|---|---|---|---|"]
    for key, s in res["summary"].items():
        lines.append(f"| {key.replace('x', ' x ')} | {s['single']['ttft_p50_s'] * 1e3:.0f} | "
                     f"{s['serial']['ttft_p50_s'] * 1e3:.0f} | {s['serial']['handover_p50_s'] * 1e3:.0f} | "
                     f"{s['concurrent']['ttft_p50_s'] * 1e3:.0f} | {s['concurrent']['handover_p50_s'] * 1e3:.0f} |")
    lines.append(f"dispatched by the concurrent router: {res['dispatched']}; wall {res['wall_s']:.0f} s")
    res["table"] = "\n".join(lines)
    print(console.wrap(res["table"]))
    write_json(ns.out or "bench-results/vllm-router.json", res)
    return 0
