"""Where the gateway decodes bodies: small ones on a thread, large ones in a lazily started process pool.

Why processes for large bodies: a thread does not keep the event loop responsive enough. Measured on a
~12 MB protobuf body with 10,000 traces (two cores), upb's single ``ParseFromString`` held the GIL for
50-100 ms, and the ~100,000 objects that validating and splitting allocate set off full garbage collections
that held it 150-470 ms (a full collection walks every object of the process, and a test process holds
millions); ``/healthz`` waited 290-790 ms. In a worker process both happen away from the event loop's GIL and
heap; what comes back is two lists of bytes (:class:`Prepared`), which the collector does not track.

Bodies under ``process_body_bytes`` stay on a thread: a process round trip (pickling the body and the
records) costs more than it saves there. ``decode_processes = 0`` keeps every body on a thread.

Lifecycle: built with the gateway; the pool starts on the first large body (``spawn``: a fresh interpreter,
not a fork of a process that runs threads, so ~1 s for the first large body); :meth:`close` stops both pools.
:meth:`prepare` raises :class:`PoisonInputError` for an undecodable body and :class:`DecoderCrashedError`
when a worker died (the pool is then replaced on the next large body).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import signal
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from fulmen.producers.otlp_gateway.otlp import Prepared, prepare
from fulmen.schemas.errors import FulmenError

__all__ = ["BodyDecoder", "DecoderCrashedError"]

log = logging.getLogger(__name__)


class DecoderCrashedError(FulmenError):
    """A decoding worker process died while it held the body (killed, out of memory, a crash in the parser)."""


class BodyDecoder:
    """Runs :func:`fulmen.producers.otlp_gateway.otlp.prepare` off the event loop (see the module docstring)."""

    def __init__(
        self, *, max_span_bytes: int, max_record_bytes: int, processes: int, process_body_bytes: int, threads: int = 2
    ) -> None:
        if processes < 0 or threads < 1:
            raise ValueError(f"processes must be >= 0 and threads >= 1, not {processes} and {threads}")
        self.max_span_bytes = max_span_bytes
        self.max_record_bytes = max_record_bytes
        self.processes = processes
        self.process_body_bytes = process_body_bytes
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="otlp-decode")
        self._pool: ProcessPoolExecutor | None = None

    def uses_process(self, body_bytes: int) -> bool:
        return self.processes > 0 and body_bytes >= self.process_body_bytes

    async def prepare(self, body: bytes, as_json: bool, *, split: bool = True) -> Prepared:
        """The body decoded, validated and (when ``split``) cut into records."""
        executor: Executor = self._process_pool() if self.uses_process(len(body)) else self._threads
        args = (body, as_json, self.max_span_bytes, self.max_record_bytes, split)
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, prepare, *args)
        except BrokenProcessPool as exc:
            codes = _exit_codes(executor)
            if executor is self._pool:
                self._pool = None
                executor.shutdown(wait=False, cancel_futures=True)
            log.error(
                "an OTLP decoding process died while decoding a %d-byte body (exit codes %s): %s", len(body), codes, exc
            )
            raise DecoderCrashedError(f"the decoding process died while decoding this body ({exc})") from None

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _process_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            log.info(
                "starting %d OTLP decoding processes (bodies of %d bytes and up)",
                self.processes,
                self.process_body_bytes,
            )
            self._pool = ProcessPoolExecutor(
                self.processes, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker
            )
        return self._pool


def _exit_codes(executor: Executor) -> list[int | None]:
    """The workers' exit codes, for the log (-9: killed, e.g. out of memory); read from a private attribute of
    ``ProcessPoolExecutor``, so anything unexpected there gives an empty list rather than an error."""
    workers = getattr(executor, "_processes", None)
    return [getattr(worker, "exitcode", None) for worker in dict(workers or {}).values()]


def _start_worker() -> None:
    """Ctrl-C reaches the whole process group: the gateway shuts its workers down, they need not react.
    The modules imported so far live as long as the worker: keep them out of every garbage collection."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.freeze()
