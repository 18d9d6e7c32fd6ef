"""Prefill -> decode through unmodified vLLM for CPU, with AiotransferConnector and with vLLM's NixlConnector.

The engines run under the vLLM venv's Python (``scripts/vllm-venv.sh`` builds it, cached per machine);
this module, run from the main venv, drives ``python -m benchmarks.vllm_pd`` there as a subprocess
and checks its JSON. The model is a Llama with seeded random weights, so the next token depends on the
context: the negative control (decode over another request's KV) must give other tokens, which proves
the token comparison can fail. One harness run is shared by many assertions to keep the engines' start-up
(about 10 s a pair on 2 cores) off most tests. Skipped when the venv cannot be built.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm.harness import assert_no_leak, assert_within_budget, run_harness

AIOTRANSFER_KINDS = ["aiotransfer-mooncake", "aiotransfer-nixl"]
"""AiotransferConnector streaming every pass whose decode has asked (``stream_layers="always"``)."""
AUTO_KIND = "aiotransfer-mooncake-auto"
"""AiotransferConnector with its default rule (``stream_layers="auto"``): every prompt here is below its floor."""
PD_KINDS = ["nixl", *AIOTRANSFER_KINDS, AUTO_KIND]
LENGTHS = [600, 100, 37, 257]  # 600 tokens span 19 blocks of 32; all four are in flight together
PREFILL_CHUNK = 128
"""The prefill's tokens per step: every prompt but the shortest is computed in chunks (chunked prefill)."""
TRANSFER_TIMEOUT = 10.0
LEASE = 10.0

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


def _engine_log_hint(result: dict[str, Any]) -> str:
    return f"engine logs in {result.get('workdir')}"


# ----------------------------------------------------------------------------------------------------
# tokens: one run gives the reference and, per connector kind, PD + negative control + leak check
# ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pd_run(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_harness(vllm_python, tmp_path_factory.mktemp("vllm-pd"), "pd", "--kinds", ",".join(PD_KINDS),
                       "--lengths", ",".join(map(str, LENGTHS)), "--negative-len", "200", "--block-size", "32",
                       "--max-tokens", "8", "--transfer-timeout", str(TRANSFER_TIMEOUT), "--lease", str(LEASE),
                       "--dispatch", "serial,concurrent", "--prefill-chunk", str(PREFILL_CHUNK))


def test_reference_is_a_real_generation(pd_run: dict[str, Any]) -> None:
    ref = pd_run["reference"]
    assert [r["outcome"] for r in ref["results"]] == ["ok"] * (len(LENGTHS) + 2)
    assert all(len(t) == 8 for t in ref["tokens"])
    assert len({tuple(t) for t in ref["tokens"]}) == len(ref["tokens"]), "different prompts, same tokens?"


@pytest.mark.parametrize("kind", PD_KINDS)
def test_pd_tokens_equal_the_single_engine(pd_run: dict[str, Any], kind: str) -> None:
    run = pd_run["runs"][kind]
    assert "error" not in run, f"{run['error']}\n{_engine_log_hint(pd_run)}"
    assert [r["outcome"] for r in run["prefill"]] == ["ok"] * len(LENGTHS)
    assert [r["outcome"] for r in run["decode"]] == ["ok"] * len(LENGTHS), run["decode"]
    assert run["tokens"] == pd_run["reference"]["tokens"][:len(LENGTHS)]
    # the KV really crossed: one load per request, of the prompt's blocks
    records = run["transfers"]["records"]
    assert len(records) == len(LENGTHS), run["transfers"]
    block_bytes = 4 * 2 * 2 * 64 * 4 * 32  # layers x K,V x KV heads x head_dim x fp32 x block_size
    assert sorted(r["bytes"] for r in records) == sorted(-(-n // 32) * block_bytes for n in LENGTHS)


@pytest.mark.parametrize("kind", PD_KINDS)
def test_negative_control_decode_over_another_requests_kv_differs(pd_run: dict[str, Any], kind: str) -> None:
    run = pd_run["runs"][kind]
    assert "error" not in run, run["error"]
    neg = run["negative"]
    assert neg["outcomes"] == ["ok", "ok"]
    ref = pd_run["reference"]["tokens"][len(LENGTHS):]
    for got, want in zip(neg["tokens"], ref, strict=True):
        assert got != want, "decode over the other prompt's KV gave the reference tokens: the test cannot fail"


@pytest.mark.parametrize("kind", PD_KINDS)
def test_pd_leaves_every_block_free(pd_run: dict[str, Any], kind: str) -> None:
    run = pd_run["runs"][kind]
    assert "error" not in run, run["error"]
    for side in ("prefill", "decode"):
        assert_no_leak(run["settle"][side], f"{kind} {side}")


@pytest.mark.parametrize("kind", AIOTRANSFER_KINDS)
def test_concurrent_dispatch_with_layer_streaming_gives_the_single_engines_tokens(pd_run: dict[str, Any],
                                                                                   kind: str) -> None:
    """Each decode request asked before its prompt was computed: the prefill pushed each chunk's blocks layer
    by layer during that chunk's forward pass. Same tokens, same bytes, and the negative control (rooms
    swapped) differs."""
    run = pd_run["runs"][kind]
    assert "error" not in run, run["error"]
    conc = run["concurrent"]
    assert [r["outcome"] for r in conc["decode"]] == ["ok"] * len(LENGTHS), conc["decode"]
    assert [r["outcome"] for r in conc["prefill"]] == ["ok"] * len(LENGTHS), conc["prefill"]
    assert conc["tokens"] == pd_run["reference"]["tokens"][:len(LENGTHS)]
    block_bytes = 4 * 2 * 2 * 64 * 4 * 32
    assert sorted(r["bytes"] for r in conc["transfers"]["records"]) == sorted(-(-n // 32) * block_bytes for n in LENGTHS)
    # the decode's metadata after the prefill finished (a decode that could not allocate at once): whole rooms
    assert [r["outcome"] for r in conc["late"]["decode"]] == ["ok"] * len(LENGTHS), conc["late"]["decode"]
    assert conc["late"]["tokens"] == pd_run["reference"]["tokens"][:len(LENGTHS)]
    neg = conc["negative"]
    assert neg["outcomes"] == ["ok", "ok"]
    for got, want in zip(neg["tokens"], pd_run["reference"]["tokens"][len(LENGTHS):], strict=True):
        assert got != want, "decode in the other prompt's room gave the reference tokens: the test cannot fail"


@pytest.mark.parametrize("kind", AIOTRANSFER_KINDS)
def test_aiotransfer_connector_counts(pd_run: dict[str, Any], kind: str) -> None:
    run = pd_run["runs"][kind]
    assert "error" not in run, run["error"]
    n = len(LENGTHS) + 2  # per dispatch: the prompts and the negative control's two
    prefill, decode = run["stats"]["prefill"], run["stats"]["decode"]
    late = len(LENGTHS)  # concurrent requests whose decode asked after the prefill finished
    assert prefill["worker"]["sends"] == 2 * n + late and prefill["worker"]["sends_failed"] == 0, prefill
    assert decode["worker"]["receives"] == 2 * n + late and decode["worker"]["receives_failed"] == 0, decode
    # every concurrent request but the late ones was asked for before its prompt was computed, and streamed
    assert prefill["worker"]["sends_asked_early"] == n and prefill["worker"]["sends_streamed"] == n, prefill
    # and chunked prompts sent blocks before their last chunk was computed
    assert prefill["worker"]["chunks_sent_early"] > 0 and prefill["worker"]["preempted"] == 0, prefill
    for stats in (prefill, decode):
        assert stats["worker"]["in_flight"] == 0 and stats["worker"]["withheld"] == 0, stats
        assert stats["scheduler"] == {"sending": 0, "receiving": 0, "prefilling": 0, "requests": 0, "refused": 0}, stats


def test_auto_sends_short_prompts_whole_after_the_pass_with_the_single_engines_tokens(pd_run: dict[str, Any]) -> None:
    """The connector's default rule: prompts of 37 to 600 tokens are below its floor, so each pass goes whole
    once it is over, also when the decode asked before it (concurrent dispatch). Same tokens, same bytes."""
    run = pd_run["runs"][AUTO_KIND]
    assert "error" not in run, f"{run['error']}\n{_engine_log_hint(pd_run)}"
    conc = run["concurrent"]
    assert [r["outcome"] for r in conc["decode"]] == ["ok"] * len(LENGTHS), conc["decode"]
    assert conc["tokens"] == pd_run["reference"]["tokens"][:len(LENGTHS)]
    block_bytes = 4 * 2 * 2 * 64 * 4 * 32
    assert sorted(r["bytes"] for r in conc["transfers"]["records"]) == sorted(-(-n // 32) * block_bytes for n in LENGTHS)
    n = len(LENGTHS) + 2  # the prompts and the negative control's two, asked before they were computed
    worker = run["stats"]["prefill"]["worker"]
    assert (worker["sends_asked_early"], worker["sends_streamed"], worker["sends_whole_by_rule"]) == (n, 0, n), worker
    assert worker["sends_failed"] == 0 and worker["in_flight"] == 0 and worker["withheld"] == 0, worker


# ----------------------------------------------------------------------------------------------------
# faults
# ----------------------------------------------------------------------------------------------------
FAULTS = [("aiotransfer-mooncake", "fail", "serial"), ("aiotransfer-mooncake", "recompute", "concurrent"),
          ("aiotransfer-nixl", "fail", "concurrent"), ("aiotransfer-nixl", "recompute", "serial")]
"""Each engine, each failure policy and each dispatch, pairwise (one engine pair per case)."""


@pytest.fixture(scope="module", params=FAULTS, ids=["-".join(f) for f in FAULTS])
def killed_prefill(request: pytest.FixtureRequest, vllm_python: str,
                   tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Serial: the prefill is killed after answering, before the decode asks. Concurrent: after the decode
    has asked, before the prefill computes (the decode waits on a prefill that dies)."""
    kind, policy, dispatch = request.param
    return run_harness(vllm_python, tmp_path_factory.mktemp(f"vllm-kill-{kind}-{policy}"), "kill-prefill",
                       "--kind", kind, "--policy", policy, "--lengths", "600,100,37", "--dispatch", dispatch,
                       "--transfer-timeout", str(TRANSFER_TIMEOUT), "--lease", str(LEASE))


def test_killed_prefill_fails_or_recomputes_within_bound(killed_prefill: dict[str, Any]) -> None:
    res = killed_prefill
    assert res["prefill_dead"], "the prefill survived SIGKILL?"
    assert res["decode_s"] < TRANSFER_TIMEOUT + 5, f"decode took {res['decode_s']:.1f} s: {res['outcomes']}"
    if res["policy"] == "fail":
        assert res["outcomes"] == ["error"] * 3, res["decode"]
    else:
        assert res["outcomes"] == ["ok"] * 3, res["decode"]
        assert res["tokens"] == res["local_tokens"]


def test_killed_prefill_leaks_no_decode_block(killed_prefill: dict[str, Any]) -> None:
    res = killed_prefill
    before = res["blocks_before"]
    assert before["free"] == before["free_idle"]
    assert_no_leak(res["settle"], "decode")
    worker = res["decode_stats"]["worker"]
    assert worker["receives"] == 3 and worker["receives_failed"] == 3, worker
    assert worker["in_flight"] == 0 and worker["withheld"] == 0, worker
    assert res["blocks_after"]["free"] == before["free_idle"]


ABORT_LEASE = 30.0
"""The prefill's lease in the abort scenario: far from the time an abort takes to reach it, even on a slow
machine, so the two cannot be mistaken for each other."""


ABORTS = [("aiotransfer-mooncake", "serial"), ("aiotransfer-nixl", "concurrent")]


@pytest.fixture(scope="module", params=ABORTS, ids=["-".join(a) for a in ABORTS])
def aborted_decode(request: pytest.FixtureRequest, vllm_python: str,
                   tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Serial: the decode aborts while its KV loads. Concurrent: while the prefill computes or pushes it,
    in chunks (chunked prefill: the abort comes between two of the 600-token prompt's chunks)."""
    kind, dispatch = request.param
    chunks = ["--prefill-chunk", str(PREFILL_CHUNK)] if dispatch == "concurrent" else []
    return run_harness(vllm_python, tmp_path_factory.mktemp(f"vllm-abort-{kind}"), "decode-abort",
                       "--kind", kind, "--lengths", "600,100", "--abort-after-steps", "1", "--dispatch", dispatch,
                       "--transfer-timeout", str(TRANSFER_TIMEOUT), "--lease", str(ABORT_LEASE), *chunks)


def test_decode_abort_returns_every_block_on_both_sides(aborted_decode: dict[str, Any]) -> None:
    res = aborted_decode
    assert res["outcomes"] == ["aborted", "ok"]
    assert res["tokens"][1] == res["local_tokens"][1]
    held = res["prefill_blocks_after_decode"]
    assert held["free"] <= held["free_idle"]
    for side in ("prefill", "decode"):
        assert_no_leak(res["settle"][side], side)
    # the prefill hears of the abort: its blocks come back well before its lease would have freed them
    # (from its prefill's end; this includes the decode's run: about a second here)
    assert res["prefill_free_after_s"] < ABORT_LEASE / 2, res["prefill_free_after_s"]
    for side in ("prefill", "decode"):
        worker = res["stats"][side]["worker"]
        assert worker["in_flight"] == 0 and worker["withheld"] == 0, worker


def test_harness_runs_fit_the_budget(pd_run: dict[str, Any]) -> None:
    """The shared run stays cheap enough for CI on 2 cores: one reference engine and one pair per kind,
    and its time mostly their start-up (see :func:`assert_within_budget`)."""
    assert_within_budget(pd_run, PD_KINDS)
    for kind in PD_KINDS:
        peaks = pd_run["runs"][kind].get("peak_rss_mib") or {}
        for side in ("prefill", "decode"):
            assert peaks.get(side) is None or peaks[side] < 2048, peaks

