"""Prefill -> decode of a hybrid model (Mamba2 + attention) through AiotransferConnector on unmodified vLLM.

The model is a GraniteMoeHybrid with two Mamba2 and two attention layers and seeded random weights
(``--model hybrid`` of the harness). vLLM's hybrid allocator lays both kinds of layer over one pool of
256 KiB pages (attention blocks of 256 tokens; one Mamba block per request). The connector sends the
attention blocks as KV pages and the Mamba block with ``KVSender.send_state``; the prefill computes the
prompt one token short and the decode computes the last prompt token over the loaded state.

Checks: the decode's tokens equal a single engine's (a 600-token prompt spans three attention blocks,
a 257-token one loads exactly one full block), the bytes moved are the attention blocks plus the state
block, and the negative control (two prompts' KV and state swapped) gives other tokens, so the
comparison can fail. A killed prefill fails the loads per request, under either failure policy.
Marked ``vllm`` and ``slow``; skipped when the vLLM venv cannot be built.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm.harness import assert_no_leak, assert_within_budget, run_harness

KINDS = ["aiotransfer-mooncake", "aiotransfer-nixl"]
LENGTHS = [600, 100, 37, 257]
MAX_TOKENS = 8
ATTENTION_BLOCK = 256  # tokens: vLLM sizes it so that an attention page holds a Mamba state
PAGE = 2 * 2 * 64 * 4 * ATTENTION_BLOCK  # K,V x KV heads x head_dim x fp32 x tokens: 256 KiB per layer
REGIONS = 2  # each region holds one attention and one Mamba layer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def hybrid_run(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_harness(vllm_python, tmp_path_factory.mktemp("vllm-hybrid"), "pd", "--model", "hybrid",
                       "--kinds", ",".join(KINDS), "--lengths", ",".join(map(str, LENGTHS)),
                       "--negative-len", "200", "--max-tokens", str(MAX_TOKENS), "--transfer-timeout", "10",
                       "--lease", "10", "--dispatch", "serial,concurrent", "--prefill-chunk", str(ATTENTION_BLOCK))


def _run(result: dict[str, Any], kind: str) -> dict[str, Any]:
    run: dict[str, Any] = result["runs"][kind]
    assert "error" not in run, f"{run['error']}\nengine logs in {result.get('workdir')}"
    return run


def test_reference_is_a_real_generation(hybrid_run: dict[str, Any]) -> None:
    ref = hybrid_run["reference"]
    assert [r["outcome"] for r in ref["results"]] == ["ok"] * (len(LENGTHS) + 2)
    assert all(len(t) == MAX_TOKENS for t in ref["tokens"])
    assert len({tuple(t) for t in ref["tokens"]}) == len(ref["tokens"]), "different prompts, same tokens?"


@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_pd_tokens_equal_the_single_engine(hybrid_run: dict[str, Any], kind: str) -> None:
    run = _run(hybrid_run, kind)
    assert [r["outcome"] for r in run["prefill"]] == ["ok"] * len(LENGTHS)
    assert [r["outcome"] for r in run["decode"]] == ["ok"] * len(LENGTHS), run["decode"]
    assert run["tokens"] == hybrid_run["reference"]["tokens"][:len(LENGTHS)]


@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_pd_moves_the_attention_blocks_and_the_mamba_state(hybrid_run: dict[str, Any], kind: str) -> None:
    """The prefill computed N-1 tokens: their attention blocks plus one state block per request crossed."""
    records = _run(hybrid_run, kind)["transfers"]["records"]
    assert len(records) == len(LENGTHS), records
    want = [(-(-(n - 1) // ATTENTION_BLOCK) + 1) * PAGE * REGIONS for n in LENGTHS]
    assert sorted(r["bytes"] for r in records) == sorted(want)


@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_negative_control_another_requests_state_and_kv_differ(hybrid_run: dict[str, Any],
                                                                      kind: str) -> None:
    neg = _run(hybrid_run, kind)["negative"]
    assert neg["outcomes"] == ["ok", "ok"]
    ref = hybrid_run["reference"]["tokens"][len(LENGTHS):]
    for got, want in zip(neg["tokens"], ref, strict=True):
        assert got != want, "decode over the other prompt's state and KV gave the reference tokens"


@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_concurrent_dispatch_streams_regions_and_gives_the_single_engines_tokens(hybrid_run: dict[str, Any],
                                                                                        kind: str) -> None:
    """The decode asked before the prompt was computed: the prefill pushed each attention region as its
    layer was written, chunk by chunk (chunked prefill, one attention block per step), and the Mamba state
    once the last chunk's pass was over. Same tokens; the late-asking decode
    (whole rooms) too; the negative control (rooms swapped) differs."""
    run = _run(hybrid_run, kind)
    conc = run["concurrent"]
    assert [r["outcome"] for r in conc["decode"]] == ["ok"] * len(LENGTHS), conc["decode"]
    assert [r["outcome"] for r in conc["prefill"]] == ["ok"] * len(LENGTHS), conc["prefill"]
    ref = hybrid_run["reference"]["tokens"]
    assert conc["tokens"] == ref[:len(LENGTHS)]
    assert conc["late"]["tokens"] == ref[:len(LENGTHS)]
    neg = conc["negative"]
    assert neg["outcomes"] == ["ok", "ok"]
    for got, want in zip(neg["tokens"], ref[len(LENGTHS):], strict=True):
        assert got != want, "decode in the other prompt's room gave the reference tokens: the test cannot fail"
    worker = run["stats"]["prefill"]["worker"]
    assert worker["sends_streamed"] == worker["sends_asked_early"] > 0, worker
    assert worker["chunks_sent_early"] > 0, worker


@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_pd_leaves_every_block_free(hybrid_run: dict[str, Any], kind: str) -> None:
    run = _run(hybrid_run, kind)
    for side in ("prefill", "decode"):
        assert_no_leak(run["settle"][side], f"{kind} {side}")
    n = 2 * (len(LENGTHS) + 2) + len(LENGTHS)  # serial and concurrent, each with the negative control; the late run
    prefill, decode = run["stats"]["prefill"], run["stats"]["decode"]
    assert prefill["worker"]["sends"] == n and prefill["worker"]["sends_failed"] == 0, prefill
    assert decode["worker"]["receives"] == n and decode["worker"]["receives_failed"] == 0, decode
    for stats in (prefill, decode):
        assert stats["worker"]["in_flight"] == 0 and stats["worker"]["withheld"] == 0, stats
        assert stats["scheduler"] == {"sending": 0, "receiving": 0, "prefilling": 0, "requests": 0, "refused": 0}, stats


def test_hybrid_run_fits_the_budget(hybrid_run: dict[str, Any]) -> None:
    assert_within_budget(hybrid_run, KINDS)
    for kind in KINDS:
        peaks = hybrid_run["runs"][kind].get("peak_rss_mib") or {}
        for side in ("prefill", "decode"):
            assert peaks.get(side) is None or peaks[side] < 2048, peaks


@pytest.fixture(scope="module", params=["fail", "recompute"])
def hybrid_killed_prefill(request: pytest.FixtureRequest, vllm_python: str,
                          tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_harness(vllm_python, tmp_path_factory.mktemp(f"vllm-hybrid-kill-{request.param}"), "kill-prefill",
                       "--model", "hybrid", "--kind", "aiotransfer-mooncake", "--policy", request.param,
                       "--lengths", "600,100,37", "--transfer-timeout", "10", "--lease", "10")


def test_hybrid_killed_prefill_fails_or_recomputes_per_request(hybrid_killed_prefill: dict[str, Any]) -> None:
    """vLLM takes a hybrid model's failed loads per request (failed_recving), and its policy applies."""
    res = hybrid_killed_prefill
    assert res["prefill_dead"] and res["decode_s"] < 15, res["decode_s"]
    if res["policy"] == "fail":
        assert res["outcomes"] == ["error"] * 3, res["decode"]
    else:
        assert res["outcomes"] == ["ok"] * 3, res["decode"]
        assert res["tokens"] == res["local_tokens"]
    worker = res["decode_stats"]["worker"]
    assert worker["receives_failed"] == 3 and worker["in_flight"] == 0 and worker["withheld"] == 0, worker
    assert res["settle"]["settled"] and res["blocks_after"]["free"] == res["blocks_before"]["free_idle"]
