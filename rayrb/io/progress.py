"""Progress of long work (prepare, write, preprocess): a bar on a terminal, plain lines elsewhere.

On a terminal a ``tqdm`` bar redraws itself in place. Where stderr is not a
terminal (a log file, CI, ``ray job submit``'s captured output), those redraws pile
up on one line, separated by carriage returns; so there each bar prints whole lines
instead: one every ``every`` seconds while the work goes on, and one when it ends.

Examples:
    >>> import io
    >>> out = io.StringIO()
    >>> bar = progress(400, desc="preprocess -> doubled", unit="rows", stream=out)
    >>> bar.update(150); bar.update(250); bar.close(); bar.close()  # closed once
    >>> out.getvalue().count("\\n"), "\\r" in out.getvalue(), out.getvalue().split(" in ")[0]
    (1, False, 'preprocess -> doubled: 400/400 rows (100%)')
"""
from __future__ import annotations

import sys
import time
from typing import Any, TextIO

EVERY = 30.0  # seconds between lines where stderr is not a terminal


def progress(total: int, *, desc: str, unit: str, initial: int = 0, enabled: bool = True,
             stream: TextIO | None = None, every: float = EVERY) -> Any:
    """A bar with ``update(n)`` and ``close()``: ``tqdm`` on a terminal, ``Lines`` elsewhere, nothing if not
    ``enabled``."""
    stream = sys.stderr if stream is None else stream
    if enabled and _is_terminal(stream):
        from tqdm.auto import tqdm

        return tqdm(total=total, unit=unit, unit_scale=True, desc=desc, initial=initial, mininterval=0.5,
                    file=stream)
    return Lines(total, desc=desc, unit=unit, initial=initial, stream=stream, every=every, enabled=enabled)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Lines:
    """Progress as whole lines: one per ``every`` seconds of work, one at the end (see the module)."""

    def __init__(self, total: int, *, desc: str, unit: str, initial: int = 0, stream: TextIO,
                 every: float = EVERY, enabled: bool = True):
        self.total, self.n, self.desc, self.unit = int(total), int(initial), desc, unit
        self._stream, self._every, self._enabled = stream, float(every), enabled
        self._t0 = self._last = time.monotonic()
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.n += int(n)
        now = time.monotonic()
        if now - self._last >= self._every:
            self._last = now
            self._line(now)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._line(time.monotonic())

    def _line(self, now: float) -> None:
        if not self._enabled:
            return
        share = f" ({100 * self.n // self.total}%)" if self.total else ""
        print(f"{self.desc}: {self.n:,}/{self.total:,} {self.unit}{share} in {now - self._t0:.1f} s",
              file=self._stream, flush=True)
