"""The vLLM connector's prefill worker with its KV in CUDA memory (``make test-gpu``): each layer's blocks
are pushed only once the kernels that write them are done, and whole rooms wait for the pass's kernels.

vLLM calls ``save_kv_layer`` once a layer's kernels are queued, not done. The forward pass here queues, for
each layer, half a second of spinning and then the write of the layer's blocks, and reports the layer at
once, as vLLM does. The decode worker runs in another process. Skipped without a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aiotransfer.integrations.vllm import _worker
from aiotransfer.integrations.vllm._scheduler import Orders, SendJob
from tests.peer import digest, make_buffers
from tests.test_gpu import DEVICE, SPIN_CYCLES, gpu_engine, pytestmark  # noqa: F401 -- the fixture and marks
from tests.test_vllm_layers import SRC, asked
from tests.test_vllm_sides import ITEM, PAGES, DecodeWorker, prefill_worker, wait_sent


def _pass(prefill: _worker.WorkerSide, kv: list[Any]) -> None:
    """The forward pass as the host sees it: each layer's kernels queued, then reported at once."""
    import torch

    blocks = torch.tensor(SRC, device=DEVICE)  # on the device first: indexing with a list would sync the host
    torch.cuda.synchronize()
    for layer, buf in enumerate(kv):
        torch.cuda._sleep(SPIN_CYCLES // 2)  # the layer's compute
        buf.index_fill_(0, blocks, 100 + layer)  # its KV, written behind the compute on the same stream
        prefill.layer_written(f"layer.{layer}")


def _negative_control(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The events removed. Mooncake's TCP transport cannot show what they prevent: on an H200 (2026-11-27) it
    delivered the new bytes without them too, most likely because it copies device memory with a
    synchronous ``cudaMemcpy``, which waits for the work queued on the default stream. NIXL (``cuda_ipc``)
    reads the blocks while the kernels still run, and shows it."""
    if engine == "mooncake_tcp":
        pytest.skip("Mooncake over TCP copies device memory after the default stream's work: nothing to show")
    monkeypatch.setattr(_worker, "device_event", lambda device: None)


def _expected(kv: list[Any]) -> str:
    import torch

    torch.cuda.synchronize()
    return digest([np.ascontiguousarray(b.cpu().numpy()) for b in kv], list(SRC))


@pytest.mark.parametrize("ordered", [True, False], ids=["events", "negative-control"])
def test_each_cuda_layer_is_pushed_only_once_its_kernels_are_done(gpu_engine: str, ordered: bool,  # noqa: F811
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    if not ordered:
        _negative_control(gpu_engine, monkeypatch)
    kv = [torch.from_numpy(b).to(DEVICE) for b in make_buffers(2, PAGES, ITEM, seed=31)]
    prefill = prefill_worker(gpu_engine, kv)
    decode = DecodeWorker(gpu_engine)
    try:
        assert prefill.streams_layers
        asked(prefill, decode, 5001)
        prefill.begin_pass(Orders(send=[SendJob("r5001", 5001, SRC)]))
        _pass(prefill, kv)
        prefill.end_pass()
        out = decode.ask(None)
        assert out["finished"] and out["load_errors"] == [], out
        assert (out["digest"] == _expected(kv)) == ordered
        wait_sent(prefill, "r5001", 10)
        assert prefill.counts()["sends_streamed"] == 1
    finally:
        decode.close()
        prefill.shutdown()


@pytest.mark.parametrize("ordered", [True, False], ids=["events", "negative-control"])
def test_a_whole_room_asked_early_waits_for_the_pass_kernels(gpu_engine: str, ordered: bool,  # noqa: F811
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Without layer streaming, a room whose decode has asked goes as soon as ``wait_for_save`` hands it
    over, which on a GPU is while the pass's kernels may still run."""
    import torch

    if not ordered:
        _negative_control(gpu_engine, monkeypatch)
    kv = [torch.from_numpy(b).to(DEVICE) for b in make_buffers(2, PAGES, ITEM, seed=32)]
    prefill = prefill_worker(gpu_engine, kv, stream_layers=False)
    decode = DecodeWorker(gpu_engine)
    try:
        asked(prefill, decode, 5002)
        _pass(prefill, kv)
        prefill.start_sends(Orders(send=[SendJob("r5002", 5002, SRC)]))  # wait_for_save
        out = decode.ask(None)
        assert out["finished"] and out["load_errors"] == [], out
        assert (out["digest"] == _expected(kv)) == ordered
        wait_sent(prefill, "r5002", 10)
    finally:
        decode.close()
        prefill.shutdown()
