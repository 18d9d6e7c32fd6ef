"""The vLLM harness behind ``python -m benchmarks.vllm_pd`` and ``python -m benchmarks vllm``.

* :mod:`~benchmarks.vllm.model`     -- a Llama checkpoint with seeded random weights
* :mod:`~benchmarks.vllm.engine`    -- one ``vllm.LLM`` per process and session, bounded commands
* :mod:`~benchmarks.vllm.server`    -- the engine process's side of those commands
* :mod:`~benchmarks.vllm.scenarios` -- reference, PD, negative control, killed prefill, aborted decode
* :mod:`~benchmarks.vllm.bench`     -- TTFT / end-to-end / transfer time per connector kind

Nothing here imports vLLM at module level; it runs only under a Python that has it (the vLLM venv).
"""

__all__: list[str] = []
