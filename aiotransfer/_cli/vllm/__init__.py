"""The vLLM harness behind ``python -m aiotransfer._cli.vllm_pd`` and ``aiotransfer bench --suite vllm``.

* :mod:`~aiotransfer._cli.vllm.model`     -- a Llama checkpoint with seeded random weights
* :mod:`~aiotransfer._cli.vllm.engine`    -- one ``vllm.LLM`` per process and session, bounded commands
* :mod:`~aiotransfer._cli.vllm.server`    -- the engine process's side of those commands
* :mod:`~aiotransfer._cli.vllm.scenarios` -- reference, PD, negative control, killed prefill, aborted decode
* :mod:`~aiotransfer._cli.vllm.bench`     -- TTFT / end-to-end / transfer time per connector kind

Nothing here imports vLLM at module level; it runs only under a Python that has it (the vLLM venv).
"""

__all__: list[str] = []
