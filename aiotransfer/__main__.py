"""``python -m aiotransfer``: see :mod:`aiotransfer._cli`."""

from __future__ import annotations

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
