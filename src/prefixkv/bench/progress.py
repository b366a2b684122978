"""A one-line progress bar on stderr, drawn only on a terminal or when asked."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``total`` steps; ``tick(label)`` announces the step about to run.

    Draws nothing unless ``enabled`` is True, or None and ``stream`` is a TTY. Not
    thread-safe; ``close()`` ends the line.
    """

    def __init__(self, total: int, enabled: bool | None = None, stream: TextIO | None = None,
                 width: int = 24) -> None:
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", lambda: False)
        self.enabled = isatty() if enabled is None else enabled
        self.total = max(total, 1)
        self.done = 0
        self.width = width
        self.start = time.monotonic()
        self._open = False      # a bar is drawn and its line not ended

    def tick(self, label: str) -> None:
        if self.enabled:
            self._draw(label)
        self.done = min(self.done + 1, self.total)

    def close(self) -> None:
        if self.enabled:
            self.done = self.total
            self._draw("done")
            self.end_line()

    def end_line(self) -> None:
        """End the bar's line where it stands (a run that stops early)."""
        if self._open:
            self._open = False
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, label: str) -> None:
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        line = (f"\r[{bar}] {self.done}/{self.total} {time.monotonic() - self.start:5.1f}s "
                f"{label[:48]}")
        self._open = True
        self.stream.write(line.ljust(90))
        self.stream.flush()
