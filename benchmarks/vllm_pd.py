"""``python -m benchmarks.vllm_pd SCENARIO --json OUT``: prefill -> decode through real vLLM engines.

Runs only with a Python that imports vLLM (``bash scripts/vllm-venv.sh`` builds one and prints its path).
Every engine is an offline ``vllm.LLM`` in its own process and session (:mod:`benchmarks.vllm.engine`)
over a Llama (or, ``--model hybrid``, a Mamba2 + attention GraniteMoeHybrid) with seeded random weights
written into the work directory (:mod:`benchmarks.vllm.model`).

Scenarios (:mod:`benchmarks.vllm.scenarios`):

* ``single``       -- one engine without a connector: the reference tokens;
* ``pd``           -- the reference, then per connector kind (``--kinds``): every prompt through prefill and
                      decode with all requests in flight together, the negative control, a leak check
                      (``--dispatch serial,concurrent``: AiotransferConnector kinds also with concurrent
                      dispatch, the decode asking before the prefill computes, so the prefill streams layers);
* ``negative``     -- ``pd`` reduced to the negative control (decode over another request's KV);
* ``kill-prefill`` -- the prefill is SIGKILLed after its outputs, before the decode runs (``--policy``);
* ``decode-abort`` -- the decode aborts a request while its KV loads; every block must come back;
* ``bench``        -- TTFT, end-to-end and transfer time per connector kind (:mod:`benchmarks.vllm.bench`);
* ``router``       -- TTFT through ``examples/vllm_pd_proxy.py`` in front of vLLM's OpenAI servers, serial
                      against ``--concurrent`` (:mod:`benchmarks.vllm.router`).

Connector kinds: ``single``, ``nixl`` (vLLM's NixlConnector), ``aiotransfer-mooncake`` and
``aiotransfer-nixl`` (AiotransferConnector over Mooncake TCP / NIXL), ``aiotransfer-nixl-spin`` (over NIXL
with UCX's progress thread spinning, as NixlConnector runs it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from aiotransfer._cli.files import write_json

from . import options

__all__ = ["VENV_HINT", "from_bench_cli", "main", "vllm_problem"]

VENV_HINT = ("this needs a Python that imports vLLM: build it with `bash scripts/vllm-venv.sh` (it prints the "
             "path of .vllm-venv/bin/python) and run the command with that Python")


def vllm_problem() -> str | None:
    """Why vLLM cannot be used from this Python (``None``: it can)."""
    if importlib.util.find_spec("vllm") is None:
        return f"vllm is not importable from {sys.executable}; {VENV_HINT}"
    return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.common(p, "vllm", repeats="rounds per concurrency; default 3, 1 with --quick", seed=True,
                   quick="256-token prompts, 1 and 4 in flight")


def from_bench_cli(ns: argparse.Namespace) -> int:
    """``python -m benchmarks vllm [--quick] [--repeats N] [--seed S] [--out JSON]`` (the vLLM venv's Python)."""
    from .vllm.bench import DEFAULT_KINDS

    argv = ["bench", "--json", ns.out or options.default_out("vllm"), "--seed", str(ns.seed), "--kinds", DEFAULT_KINDS,
            "--omp-split"]
    if ns.quick:
        argv.append("--quick")
    if ns.repeats is not None:
        argv += ["--repeats", str(ns.repeats)]
    return main(argv)


def _lengths(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_pd",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("scenario", choices=("single", "pd", "negative", "kill-prefill", "decode-abort", "bench", "router"))
    p.add_argument("--json", dest="out", default=None, help="write the results here (JSON)")
    p.add_argument("--workdir", default=None, help="model, engine logs (default: a new temporary directory)")
    p.add_argument("--kinds", default="nixl,aiotransfer-mooncake,aiotransfer-nixl,aiotransfer-nixl-spin",
                   help="connector kinds, comma-separated (pd, negative, bench)")
    p.add_argument("--kind", default="aiotransfer-mooncake", help="connector kind (kill-prefill, decode-abort)")
    p.add_argument("--prompts", default=None, help="JSON file: a list of prompts (lists of token ids)")
    p.add_argument("--lengths", default="600,100,37,257", help="prompt lengths when generated (default %(default)s)")
    p.add_argument("--negative-len", type=int, default=200,
                   help="length of the two prompts of the negative control (0: none; default %(default)s)")
    p.add_argument("--dispatch", default="serial",
                   help="pd: serial and/or concurrent (AiotransferConnector kinds), comma-separated; kill-prefill, "
                        "decode-abort: one of them (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--model-seed", type=int, default=0, help="weight seed")
    p.add_argument("--no-reference", action="store_true", help="pd: skip the single-engine reference")
    p.add_argument("--model", choices=("llama", "hybrid"), default="llama",
                   help="llama, or hybrid: Mamba2 and attention layers (default %(default)s)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default 32; bench 128; hybrid: vLLM's choice)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-mib", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="the prefill engine's tokens per step: longer prompts are computed in chunks (chunked prefill)")
    p.add_argument("--max-tokens", type=int, default=8, help="decode tokens per request")
    p.add_argument("--transfer-timeout", type=float, default=10.0, help="connector transfer bound (s)")
    p.add_argument("--lease", type=float, default=10.0, help="prefill lease (s), both connector families")
    p.add_argument("--policy", choices=("fail", "recompute"), default="fail", help="kv_load_failure_policy")
    p.add_argument("--abort-after-steps", type=int, default=1, help="decode-abort: engine steps before the abort")
    p.add_argument("--omp-split", action="store_true",
                   help="run the prefill engine process on core 0 and the decode's on core 1 (bench: the default)")
    bench = p.add_argument_group("bench")
    bench.add_argument("--tokens", default="1024,4096", help="prompt lengths, comma-separated (default %(default)s)")
    bench.add_argument("--concurrency", default="1,8", help="requests in flight (default %(default)s)")
    bench.add_argument("--repeats", type=int, default=None, help="rounds per concurrency (default 3; 1 with --quick)")
    bench.add_argument("--quick", action="store_true", help="256-token prompts, 1 and 4 in flight")
    bench.add_argument("--engine", default="mooncake_tcp", help="router: the connector's engine (default %(default)s)")
    return p


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the engines' teardown


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    problem = vllm_problem()
    if problem is not None:
        print(f"aiotransfer vLLM harness: {problem}", file=sys.stderr)
        return 2
    from .vllm import scenarios as sc
    from .vllm.model import make_tiny_hybrid, make_tiny_llama
    from .vllm.spec import KINDS

    kinds = [k for k in ns.kinds.split(",") if k]
    for k in [*kinds, ns.kind]:
        if k not in KINDS:
            print(f"unknown connector kind {k!r}; expected one of {KINDS}", file=sys.stderr)
            return 2
    if ns.block_size is None and ns.model == "llama":
        ns.block_size = 128 if ns.scenario in ("bench", "router") else 32
    workdir = ns.workdir or tempfile.mkdtemp(prefix="aiotransfer-vllm-")
    os.makedirs(workdir, exist_ok=True)
    if ns.scenario == "router":
        from .vllm.router import run_router_bench

        return run_router_bench(ns, workdir)
    if ns.scenario == "bench":
        if ns.model != "llama":
            print("bench: only --model llama", file=sys.stderr)
            return 2
        from .vllm.bench import run_bench

        return run_bench(ns, workdir)
    t0 = time.monotonic()
    make_model = make_tiny_hybrid if ns.model == "hybrid" else make_tiny_llama
    model = make_model(os.path.join(workdir, "model"), seed=ns.model_seed)
    opts = sc.Options(model=model, workdir=workdir, block_size=ns.block_size, max_model_len=ns.max_model_len,
                      kv_cache_bytes=ns.kv_cache_mib << 20, max_tokens=ns.max_tokens,
                      transfer_timeout=ns.transfer_timeout, lease=ns.lease, policy=ns.policy,
                      omp_split=ns.omp_split, prefill_chunk=ns.prefill_chunk)
    if ns.prompts:
        with open(ns.prompts) as f:
            prompts = [list(map(int, x)) for x in json.load(f)]
    else:
        prompts = sc.make_prompts(ns.seed, _lengths(ns.lengths))
    negative = sc.make_prompts(ns.seed + 1, [ns.negative_len] * 2) if ns.negative_len > 0 else None
    result: dict[str, Any]
    if ns.scenario == "single":
        result = sc.single(opts, prompts)
    elif ns.scenario == "pd":
        result = sc.pd(opts, kinds, prompts, negative, reference=not ns.no_reference,
                       dispatch=[d for d in ns.dispatch.split(",") if d])
    elif ns.scenario == "negative":
        if negative is None:
            print("negative: --negative-len must be > 0", file=sys.stderr)
            return 2
        result = sc.pd(opts, kinds, [], negative, reference=not ns.no_reference)
    elif ns.scenario == "kill-prefill":
        result = sc.kill_prefill(opts, ns.kind, prompts, dispatch=ns.dispatch)
    else:
        result = sc.decode_abort(opts, ns.kind, prompts, after_steps=ns.abort_after_steps, dispatch=ns.dispatch)
    result["options"] = {k: v for k, v in vars(ns).items() if k != "out"}
    result["workdir"] = workdir
    result["harness_wall_s"] = time.monotonic() - t0
    if ns.out:
        write_json(ns.out, result)
    else:
        json.dump(result, sys.stdout, indent=1, default=str)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
