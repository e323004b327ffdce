"""Keep native libraries' console lines out of the user's output.

Two libraries remat calls print from C++ straight to the process's file descriptors,
where Python's ``sys.stdout`` / ``sys.stderr`` redirection cannot reach them:

* kineto (the torch profiler) writes ``USDT:... profiler_start`` / ``profiler_stop`` to
  fd 2 on every profiling session, unless ``KINETO_LOG_LEVEL`` was set before its first
  use (the CLI does that; a library cannot without changing every later profiler in
  the process);
* HiGHS (the ``optimal`` planner) writes a two-line banner to fd 1 when the first solver
  is created, which would precede the JSON object of ``fxopt remat --json``.

:func:`without_lines` sends the descriptor to a temporary file for the few calls that
print, and writes back every other line afterwards.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

# "USDT:2026-11-24 02:55:03 7634:7634 SyncActivityProfilerHandler.cpp:52] profiler_start";
# the level letters vary (I, W, USDT), the rest of the prefix does not.
KINETO_LOG = re.compile(rb"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\.cpp:\d+\] ")
# "Running HiGHS 1.16.0 (git hash: ...): Copyright (c) 2026 under MIT licence terms" and
# "Includes third-party software components, see THIRD_PARTY_NOTICES.md ...".
HIGHS_BANNER = re.compile(rb"^(Running HiGHS \d|Includes third-party software components)")


@contextlib.contextmanager
def without_lines(fd: int, pattern: re.Pattern[bytes]) -> Iterator[None]:
    """While the block runs, keep lines matching ``pattern`` off file descriptor ``fd``
    (1 or 2); everything else written there is written back, in order, afterwards."""
    stream = sys.stdout if fd == 1 else sys.stderr
    try:
        stream.flush()
        saved = os.dup(fd)
    except (OSError, ValueError, AttributeError):  # no such descriptor: nothing to hide
        yield
        return
    with tempfile.TemporaryFile() as buffer:
        os.dup2(buffer.fileno(), fd)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
            os.dup2(saved, fd)
            os.close(saved)
            buffer.seek(0)
            kept = [line for line in buffer if not pattern.match(line)]
            if kept:
                os.write(fd, b"".join(kept))
