"""Runs at start-up of a Python whose PYTHONPATH starts with this directory (the SGLang interop
processes only): installs the torchvision stand-in, see interop_stubs.py."""

import importlib

importlib.import_module("interop_stubs").install()
