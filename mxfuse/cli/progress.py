"""One-line progress indicators for the command's long steps (compiles, model builds)."""

from __future__ import annotations

import logging
import threading
import time
from typing import TextIO

# Modules that log a line the first time they are imported, which would otherwise land in
# the middle of a progress line (stderr and stdout share the terminal).
_NOISY_IMPORTS = {"torch.utils.cpp_extension": "No CUDA runtime is found"}


def quiet_torch_imports():
    """Import what Inductor imports mid-compile and logs from, before any progress line, without its notices.

    `torch.utils.cpp_extension` logs "No CUDA runtime is found, using CUDA_HOME=..." on a
    machine with a CUDA toolkit and no GPU; the command says which device it uses itself.
    """
    import importlib

    for module, notice in _NOISY_IMPORTS.items():
        logger = logging.getLogger(module)
        drop = _DropNotice(notice)
        logger.addFilter(drop)
        try:
            importlib.import_module(module)
        finally:
            logger.removeFilter(drop)


class _DropNotice(logging.Filter):
    def __init__(self, notice: str):
        super().__init__()
        self.notice = notice

    def filter(self, record: logging.LogRecord) -> bool:
        return self.notice not in record.getMessage()


class _HeldRecords(logging.Handler):
    """Keeps the `mxfuse` logger's records while a progress line is open, to emit them after it."""

    def __init__(self):
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class Progress:
    """`label ... done in X s` on one line (a live timer on a terminal). What the `mxfuse` logger says
    meanwhile (the pass's warning about a norm it left) is held and emitted after the line, not inside it."""

    def __init__(self, label: str, out: TextIO):
        self.label, self.out = label, out
        self.live = bool(getattr(out, "isatty", lambda: False)())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._held = _HeldRecords()
        self._logger = logging.getLogger("mxfuse")
        self._saved: tuple[list[logging.Handler], bool] = ([], True)
        self.elapsed = 0.0

    def __enter__(self):
        self._saved = (self._logger.handlers[:], self._logger.propagate)
        self._logger.handlers, self._logger.propagate = [self._held], False  # held, emitted after the line
        self.t0 = time.perf_counter()
        self.out.write(f"{self.label} ...")
        self.out.flush()
        if self.live:
            thread = threading.Thread(target=self._tick, daemon=True)
            thread.start()
            self._thread = thread
        return self

    def _tick(self):
        spinner = "|/-\\"
        i = 0
        while not self._stop.wait(0.25):
            elapsed = time.perf_counter() - self.t0
            self.out.write(f"\r{self.label} ... {spinner[i % 4]} {elapsed:5.1f} s")
            self.out.flush()
            i += 1

    def __exit__(self, exc_type, exc, tb):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.elapsed = time.perf_counter() - self.t0
        prefix = f"\r{self.label} ..." if self.live else ""
        status = "failed" if exc_type else "done"
        self.out.write(f"{prefix} {status} in {self.elapsed:.1f} s" + (" " * 8 if self.live else "") + "\n")
        self.out.flush()
        self._logger.handlers, self._logger.propagate = self._saved
        for record in self._held.records:
            self._logger.handle(record)  # the logger's own handlers, its parents', or logging's last resort
        self._held.records.clear()
        return False


class RankProgress:
    """Progress of a spawned rank: rank 0 sends start/end events to the parent, which draws the line."""

    def __init__(self, events, label: str, enabled: bool):
        self.events, self.label, self.enabled = events, label, enabled
        self.elapsed = 0.0

    def __enter__(self):
        self.t0 = time.perf_counter()
        if self.enabled:
            self.events.send("start", self.label)
        return self

    def __exit__(self, exc_type, exc, tb):
        self.elapsed = time.perf_counter() - self.t0
        if self.enabled:
            self.events.send("end", exc_type is None)
        return False


class ProgressFromEvents:
    """The parent's side of `RankProgress`: turns the events of rank 0 into `Progress` lines."""

    def __init__(self, out: TextIO, prefix: str = "[rank 0] ", starting: str | None = None):
        """`starting`: a line of the parent's own, shown until the first event (the ranks starting up)."""
        self.out, self.prefix = out, prefix
        self.current: Progress | None = Progress(starting, out).__enter__() if starting else None
        self._starting = starting is not None

    def __call__(self, rank: int, event: tuple):
        if self._starting:  # the first event: the ranks are up
            self.close(failed=False)
            self._starting = False
        if event[0] == "start":
            self.current = Progress(self.prefix + event[1], self.out).__enter__()
        elif event[0] == "end" and self.current is not None:
            self.current.__exit__(None if event[1] else RuntimeError, None, None)
            self.current = None

    def close(self, failed: bool):
        """End a line still open (a rank failed mid-step)."""
        if self.current is not None:
            self.current.__exit__(RuntimeError if failed else None, None, None)
            self.current = None
