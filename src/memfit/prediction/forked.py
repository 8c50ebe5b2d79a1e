"""Work taken in a forked process while this process does its own: a deep model's two shallow traces at once.

A deep model's log is built from traces of it at two depths, one block apart (``DeepSession``): two independent
traces of seconds each, which one process takes one after the other; and each estimate replays two logs, the
traced batch's and another's, independent too. Where the machine has two cores to spare, ``aside`` forks a child
that takes one of the two (the deeper model's trace, the other batch's replay) while the parent does the other,
and sends its result back as plain data (``memfit.tracing.trace_data``, what the trace cache keeps; no pickle).

The answer is the one a single process gives, by construction: a trace or a replay is a function of the step
alone, and any child that did something the parent would have shown (a warning, a line on stdout or stderr),
failed, or did not answer in time is discarded, so that the parent does that work itself.

A fork is only made where it is safe and can help: on Linux, with two usable cores and nothing else running on
the second, no device runtime started (CUDA not initialised), no process group, and no other thread alive but
daemon ones. ``MEMFIT_PARALLEL_TRACES=off`` turns it off.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from memfit.devices import registered_backends

__all__ = ["PARALLEL_ENV", "aside", "can_fork"]

PARALLEL_ENV = "MEMFIT_PARALLEL_TRACES"
_OFF = ("0", "off", "false", "no")
# how long the parent waits for its child once its own trace is done: the two traces take about as long as each
# other (the child's model is one block deeper), so a child this much slower is stuck, not busy
_PATIENCE = 3.0
_LEAST_WAIT_S = 30.0


def can_fork() -> bool:
    """Whether a child can work here safely, and beside this process rather than in its way."""
    return _safe() and _nothing_started() and _no_other_threads() and _idle_core()


def _safe() -> bool:
    """Turned on, Linux, two usable cores."""
    if os.environ.get(PARALLEL_ENV, "on").strip().lower() in _OFF or sys.platform != "linux":
        return False
    return len(os.sched_getaffinity(0)) >= 2


def _nothing_started() -> bool:
    """No device runtime (CUDA) and no process group started in this process."""
    if any(backend.in_use() for backend in registered_backends()):
        return False
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def _no_other_threads() -> bool:
    """No thread alive but this one and daemon ones (a fork copies only this thread, and the locks of the others)."""
    return all(thread.daemon for thread in threading.enumerate() if thread is not threading.current_thread())


def _idle_core() -> bool:
    """Whether a core is free for the child: nothing else runs now that would leave it none (on a machine busy with
    other work, a child only slows this process down). The last minute's load average where the number of
    runnable tasks cannot be read."""
    cores = len(os.sched_getaffinity(0))
    others = _runnable()
    if others is None:
        return os.getloadavg()[0] <= cores - 1
    return others + 2 <= cores  # this process, its child, and what else runs


def _runnable() -> int | None:
    """How many tasks besides this one are runnable now (``/proc/loadavg``), or ``None``."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def aside(compute: Callable[[], Any], deliver: Callable[[Any, float], None]) -> Iterator[None]:
    """Run ``compute()`` (returning plain data) in a forked child while the ``with`` body runs here; after the body,
    ``deliver(data, seconds)`` with what the child computed and how long it took, unless the child was discarded
    (then nothing is delivered). Without a fork (``can_fork``), the body runs alone."""
    child = _fork(compute) if can_fork() else None
    started = time.perf_counter()
    try:
        yield
    except BaseException:
        if child is not None:
            _end(child[0])
        raise
    if child is None:
        return
    pid, read = child
    wait_s = max(_LEAST_WAIT_S, _PATIENCE * (time.perf_counter() - started))
    reply = _read(read, wait_s)
    _end(pid)
    if reply is not None and "data" in reply:
        deliver(reply["data"], float(reply["seconds"]))


def _fork(compute: Callable[[], Any]) -> tuple[int, int] | None:
    for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    read, write = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read)
        os.close(write)
        return None
    if pid == 0:  # the child: compute, answer, and leave without running anything of the parent's at exit
        os.close(read)
        try:
            _answer(write, compute)
        finally:
            os._exit(0)
    os.close(write)
    return pid, read


def _answer(write: int, compute: Callable[[], Any]) -> None:
    """The child's work: ``compute()`` with its output caught; ``{"data", "seconds"}``, or ``{"discarded": why}``
    where the parent must do the work itself."""
    reply: dict[str, Any]
    try:
        with tempfile.TemporaryFile() as output:
            for fd in (1, 2):
                os.dup2(output.fileno(), fd)
            # Python's streams too, whatever they were (a test's capture writes to memory, not to a descriptor)
            sys.stdout = sys.stderr = open(output.fileno(), "w", closefd=False)  # noqa: SIM115 - the child's, to its end
            started = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:  # the filters stay the parent's
                data = compute()
            seconds = time.perf_counter() - started
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            if caught or os.fstat(output.fileno()).st_size:
                reply = {"discarded": "the trace said something the parent would have shown"}
            else:
                reply = {"data": data, "seconds": seconds}
        payload = json.dumps(reply).encode()
    except BaseException as error:  # any failure is the parent's to meet, in its own trace
        payload = json.dumps({"discarded": f"{type(error).__name__}: {error}"}).encode()
    view = memoryview(payload)
    while view:
        view = view[os.write(write, view) :]
    os.close(write)


def _read(read: int, wait_s: float) -> dict[str, Any] | None:
    """The child's reply, or ``None`` if it did not send all of it within ``wait_s`` seconds."""
    chunks: list[bytes] = []
    deadline = time.monotonic() + wait_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read], [], [], left)[0]:
                return None
            chunk = os.read(read, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read)
    try:
        reply = json.loads(b"".join(chunks))
    except ValueError:
        return None
    return reply if isinstance(reply, dict) else None


def _end(pid: int) -> None:
    """Stop the child if it still runs, and reap it."""
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.waitpid(pid, 0)
