"""What a long-running tool prints, and where: tables within :data:`WIDTH` columns, a progress indicator,
and the engines' own log lines kept out of both.

* :func:`table` -- rows of cells as text; when the natural layout is wider than :data:`WIDTH`, the widest
  columns are wrapped inside their cells.
* :func:`wrap` -- text whose lines are longer than :data:`WIDTH`, wrapped with a hanging indent.
* :func:`count` -- a number and its noun, singular or plural.
* :func:`session` -- for the duration of a run: file descriptors 1 and 2 (where native libraries such as
  Mooncake's glog and every child process write) go to a log file, Python's ``sys.stdout`` and
  ``sys.stderr`` keep the terminal and wrap long lines, and a progress indicator runs: a status line
  redrawn in place on a terminal, a plain line at least every :data:`EVERY` seconds otherwise.
* :func:`note` -- a progress message (a line of its own, and the status the indicator repeats).
"""

from __future__ import annotations

import contextlib
import os
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from typing import IO

__all__ = ["EVERY", "WIDTH", "Progress", "count", "log_tail", "note", "session", "table", "wrap"]

WIDTH = 100
"""Widest line the tools print."""
EVERY = 2.0
"""Longest silence (seconds) on a stream that is not a terminal while a session runs."""


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: ``1 request``, ``4 requests``, ``1,000 pages``."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def wrap(text: str, width: int = WIDTH, indent: str = "    ") -> str:
    """``text`` with every line longer than ``width`` wrapped; continuation lines get the line's own leading
    whitespace plus ``indent``."""
    out: list[str] = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        lead = line[: len(line) - len(line.lstrip())]
        out += textwrap.wrap(line.strip(), width, initial_indent=lead, subsequent_indent=lead + indent,
                             break_on_hyphens=False) or [line[:width]]
    return "\n".join(out)


def table(rows: Sequence[Sequence[str]], width: int = WIDTH, gap: int = 2, rule: bool = True) -> str:
    """``rows[0]`` is the header (followed by a rule of dashes when ``rule``). Columns are as wide as their
    widest cell; when that makes a line wider than ``width``, the widest columns shrink (first not below their
    header nor 8, then not below the header's longest word nor 6) and their cells wrap onto further lines."""
    if not rows:
        return ""
    ncol = max(len(r) for r in rows)
    cells = [[str(c) for c in r] + [""] * (ncol - len(r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(ncol)]
    # first the cells wrap, then (still too wide) the headers too, down to their longest word
    for floor in ([max(8, len(cells[0][i])) for i in range(ncol)],
                  [max(6, *map(len, cells[0][i].split() or [""])) for i in range(ncol)]):
        while sum(widths) + gap * (ncol - 1) > width:
            i = max(range(ncol), key=lambda k: widths[k] - floor[k])
            if widths[i] <= floor[i]:
                break
            widths[i] -= 1
    lines: list[str] = []
    for n, row in enumerate(cells):
        parts = [textwrap.wrap(c, w, break_on_hyphens=False) or [""] if len(c) > w else [c]
                 for c, w in zip(row, widths, strict=True)]
        lines.extend((" " * gap).join((p[k] if k < len(p) else "").ljust(w)
                                      for p, w in zip(parts, widths, strict=True)).rstrip()
                     for k in range(max(len(p) for p in parts)))
        if n == 0 and rule:
            lines.append((" " * gap).join("-" * w for w in widths))
    return "\n".join(lines)


class _Wrapping:
    """A text stream over a file descriptor of its own (:attr:`raw`) that wraps complete lines to
    :data:`WIDTH` and, on a terminal, clears the progress status line before writing."""

    def __init__(self, fd: int, like: IO[str], progress: Progress) -> None:
        self.raw = os.fdopen(fd, "w", buffering=1, encoding=getattr(like, "encoding", None) or "utf-8",
                               errors="replace")
        self._partial = ""
        self._progress = progress

    def write(self, text: str) -> int:
        self._partial += text
        if "\n" in self._partial:
            done, self._partial = self._partial.rsplit("\n", 1)
            self._progress.emit(self.raw, wrap(done) + "\n")
        return len(text)

    def flush(self) -> None:
        if self._partial:
            self._progress.emit(self.raw, self._partial)
            self._partial = ""
        self.raw.flush()

    def isatty(self) -> bool:
        return self.raw.isatty()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.flush()
        self.raw.close()

    @property
    def encoding(self) -> str:
        return self.raw.encoding


class Progress:
    """The status of a run: :meth:`say` prints a line and makes it the status; a thread repeats the status with
    the elapsed time -- redrawn in place on a terminal, as a plain line after :data:`EVERY` seconds of silence
    otherwise."""

    def __init__(self, every: float = EVERY) -> None:
        self.every = every
        self.status = "starting"
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._last = self._t0
        self._drawn = False
        self._err: IO[str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, err: IO[str]) -> None:
        self._err = err
        self._thread = threading.Thread(target=self._tick, name="aiotransfer-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            self._clear()

    def say(self, message: str) -> None:
        self.status = message.strip()
        if self._err is None:
            print(message, file=sys.stderr, flush=True)
            return
        self.emit(self._err, wrap(message) + "\n")

    def emit(self, stream: IO[str], text: str) -> None:
        with self._lock:
            self._clear()
            stream.write(text)
            stream.flush()
            self._last = time.monotonic()

    def _clear(self) -> None:
        if self._drawn and self._err is not None:
            self._err.write("\r\x1b[K")
            self._err.flush()
            self._drawn = False

    def _tick(self) -> None:
        assert self._err is not None
        tty = self._err.isatty()
        spin = "|/-\\"
        n = 0
        while not self._stop.wait(0.25 if tty else 0.5):
            now = time.monotonic()
            with self._lock:
                elapsed = f"{now - self._t0:.0f} s"
                if tty:
                    n += 1
                    line = f"{spin[n % 4]} {elapsed}  {self.status}"[: WIDTH - 1]
                    self._err.write("\r\x1b[K" + line)
                    self._err.flush()
                    self._drawn = True
                elif now - self._last >= self.every:
                    self._err.write(f"  ... {elapsed}: {self.status}"[:WIDTH] + "\n")
                    self._err.flush()
                    self._last = now


_current: Progress | None = None


def note(message: str) -> None:
    """A progress message: a line on stderr, and the status the running session's indicator repeats."""
    if _current is not None:
        _current.say(message)
    else:
        print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def session(log_path: str | None) -> Iterator[Progress]:
    """Run the body with engine logs in ``log_path`` (when given) and a progress indicator; see the module
    docstring. Nested sessions share the outer one."""
    global _current
    if _current is not None:
        yield _current
        return
    progress = Progress()
    sys.stdout.flush()
    sys.stderr.flush()
    old_out, old_err = sys.stdout, sys.stderr
    saved = (os.dup(1), os.dup(2))
    try:
        if log_path:
            os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
            log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(log)
        out, err = _Wrapping(os.dup(saved[0]), old_out, progress), _Wrapping(os.dup(saved[1]), old_err, progress)
        sys.stdout, sys.stderr = out, err
        progress.start(err.raw)
        _current = progress
        try:
            yield progress
        finally:
            _current = None
            progress.stop()
            out.close()
            err.close()
    finally:
        sys.stdout, sys.stderr = old_out, old_err
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def log_tail(path: str, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file (empty when it cannot be read)."""
    try:
        with open(path, errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError:
        return ""
