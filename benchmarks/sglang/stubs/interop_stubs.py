"""Import-time stand-ins for the SGLang interop processes (tests/interop/, python -m benchmarks sglang), nothing else.

``install()`` puts a meta path finder first on ``sys.meta_path`` that answers every ``torchvision`` and
``torchvision.*`` import with an empty package whose ``__version__`` is ``"0.0.0"``. The torchvision wheel
on this machine is a CUDA build that fails to load against the CPU torch, and SGLang's import chain touches
torchvision only for multimodal models, never for KV transfer. ``IPython.display`` is a plain stub package
beside this file (sglang.utils imports ``HTML`` and ``display`` from it at module level).

This directory goes first on ``sys.path`` (PYTHONPATH) in the SGLang processes only; ``sitecustomize``
beside this file calls ``install()`` at interpreter start-up, and benchmarks/sglang/peer.py calls it too.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

STUBBED = ("torchvision",)


class _EmptyLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # default module creation

    def exec_module(self, module: types.ModuleType) -> None:
        module.__version__ = "0.0.0"  # type: ignore[attr-defined]
        module.__path__ = []  # a package, so any submodule import also comes here


class StubFinder(importlib.abc.MetaPathFinder):
    """Finds ``torchvision`` and all its submodules as empty packages."""

    def __init__(self, names: Sequence[str] = STUBBED) -> None:
        self.names = tuple(names)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".", 1)[0] not in self.names:
            return None
        return importlib.machinery.ModuleSpec(fullname, _EmptyLoader(), is_package=True)


def _prime_transformers() -> None:
    """Let transformers see torchvision as absent, as it is.

    transformers decides once per process (``is_torchvision_available`` is ``lru_cache``d, and answers from
    ``importlib.util.find_spec``) whether to import torchvision's real API (``InterpolationMode`` ...) at
    module level. Asking it before the stand-in exists caches ``False``; SGLang's unconditional
    ``import torchvision.transforms`` lines are then served by the empty stand-in.
    """
    try:
        import_utils = importlib.import_module("transformers.utils.import_utils")
    except ImportError:
        return
    for name in ("is_torchvision_available", "is_torchvision_v2_available"):
        probe = getattr(import_utils, name, None)
        if probe is not None:
            probe()


def install() -> None:
    """Idempotent."""
    if not any(isinstance(f, StubFinder) for f in sys.meta_path):
        _prime_transformers()
        sys.meta_path.insert(0, StubFinder())
