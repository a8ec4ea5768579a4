"""Keep the libraries' own output (lm-eval's and transformers' logging, tqdm bars such as the GGUF converter's,
Python warnings) out of the terminal: into the run's log file, with each progress bar reduced to the last state it
showed, so that the log reads as lines rather than thousands of carriage-return fragments.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

RUN_LOG = "run.log"
# Loggers of the libraries a run calls; each gets the log file instead of its own handlers for the duration.
LIBRARY_LOGGERS = (
    "lm_eval",
    "lm-eval",
    "transformers",
    "datasets",
    "huggingface_hub",
    "filelock",
    "fsspec",
    "urllib3",
    "httpx",
)
_INFO_LOGGERS = ("lm_eval",)  # worth their INFO lines in the log (the others would repeat every HTTP request)


class BarCollapsingWriter(io.TextIOBase):
    """A text stream appending to the file `path` (created on the first line) that writes whole lines, keeping of
    each line only what follows its last carriage return (what a terminal would finally show). Once detached,
    writes go to `after` as they come (a handler that a library created meanwhile may hold on to this stream)."""

    def __init__(self, path: Path, after: TextIO) -> None:
        self.path, self.after = path, after
        self._out: TextIO | None = None
        self._line = ""
        self._detached = False

    def _emit(self, line: str) -> None:
        if self._out is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._out = self.path.open("a", encoding="utf-8")
        self._out.write(line + "\n")

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        if self._detached:
            return self.after.write(text)
        self._line += text
        *done, self._line = self._line.split("\n")
        for line in done:
            self._emit(line.rsplit("\r", 1)[-1])
        if "\r" in self._line:
            self._line = self._line.rsplit("\r", 1)[-1]
        return len(text)

    def flush(self) -> None:
        if self._detached:
            self.after.flush()
        elif self._out is not None:
            self._out.flush()

    def detach(self) -> None:
        """Write what is left of an unfinished line and close the file; later writes go to `after`."""
        if self._line.strip():
            self._emit(self._line)
        self._line = ""
        if self._out is not None:
            self._out.close()
        self._detached = True


@contextlib.contextmanager
def library_output_to(log_path: Path) -> Iterator[None]:
    """For the duration: the library loggers and everything written to sys.stderr go to `log_path` (appended;
    created only if something is written)."""
    sink = BarCollapsingWriter(log_path, sys.stderr)
    handler = logging.StreamHandler(sink)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved = []
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.handlers[:], logger.propagate, logger.level))
        logger.handlers = [handler]
        logger.propagate = False
        if name in _INFO_LOGGERS and logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
    stderr, sys.stderr = sys.stderr, sink
    try:
        yield
    finally:
        sys.stderr = stderr
        sink.detach()
        for logger, handlers, propagate, level in saved:
            logger.handlers, logger.propagate = handlers, propagate
            logger.setLevel(level)
