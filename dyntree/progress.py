"""Progress lines for start-up work: what the package is doing while a step takes more than a
second or two (a download, a per-machine timing, a cost model), on stderr as ``[dyntree] ...``.

Everything goes through the ``dyntree`` logger at level INFO. Unless the application configured
that logger itself (a handler of its own), the lines are printed to the ``sys.stderr`` of the
moment; ``logging.getLogger("dyntree").setLevel(logging.WARNING)`` silences them.
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager
from typing import Iterator

__all__ = ["log", "step"]

log = logging.getLogger("dyntree")


class _Stderr(logging.Handler):
    """Writes each record to the current ``sys.stderr`` (so a redirected or captured stderr gets it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - logging must never break the caller
            self.handleError(record)


if not log.handlers:
    _handler = _Stderr()
    _handler.setFormatter(logging.Formatter("[dyntree] %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False


@contextmanager
def step(what: str) -> Iterator[None]:
    """Say ``what`` is being done (``"timing ..."``), then, when the block ends, how long it took."""
    log.info("%s ...", what)
    start = time.perf_counter()
    yield
    log.info("... done in %.1f s", time.perf_counter() - start)
