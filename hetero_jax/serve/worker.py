"""One engine worker: a thread that runs the model for one request at a time, in arrival order.

The model's caches are donated to every jitted call and a ``Session`` answers one question at a time, so one
thread owns all compute; the web server's event loop only parses, queues and streams. A request whose client
went away is cancelled: skipped if still queued, stopped at its next token if running (the turn then fails, and
its ``Session`` restores itself).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from typing import Any, Callable

log = logging.getLogger("hetero_jax.serve")


class ClientGone(Exception):
    """The request's client disconnected; its job stops (a failed turn: the session is left as it was)."""


class QueueFull(Exception):
    """More requests are waiting than ``max_queue``."""


class EngineStopped(Exception):
    """The worker was stopped (the server is shutting down): no job is taken any more."""


class Job:
    """A queued request: ``run(job)`` is called on the worker thread; its result or exception lands in
    ``future``. ``cancel()`` (any thread) stops it at the next ``check()``."""

    def __init__(self, run: Callable[["Job"], Any]):
        self.run = run
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def check(self) -> None:
        """Raise ClientGone if the job was cancelled (called between tokens)."""
        if self._cancelled.is_set():
            raise ClientGone("the client disconnected")


def _tell(job: Job, error: BaseException) -> None:
    """Fail ``job``'s future with ``error``, unless the future was cancelled (nobody waits on it then; setting it
    would raise InvalidStateError)."""
    if job.future.set_running_or_notify_cancel():
        job.future.set_exception(error)


class EngineWorker:
    """The thread that runs jobs in order; at most ``max_queue`` jobs wait (running one not counted). A queued job
    whose client left holds no place: it is dropped when a job is submitted, and never counted. The thread starts
    with ``start()`` (the app's lifespan) or else with the first job (an app mounted in another, whose lifespan
    never runs); after ``stop()`` every job is refused with ``EngineStopped``."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self._jobs: collections.deque = collections.deque()  # Job, or None: the end of the thread
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.running = False  # a job is on the engine now

    def _refuse_if_stopped(self) -> None:
        """EngineStopped after ``stop()`` (called with the lock held): a job queued behind the end would wait
        forever."""
        if self._stopped:
            raise EngineStopped("the engine worker was stopped (the server is shutting down); start a new server")

    def start(self) -> None:
        """Start the thread, once; a second call (the lifespan after a first job) does nothing."""
        with self._ready:
            self._refuse_if_stopped()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="hetero-jax-engine", daemon=True)
                self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the running job, cancel the queued ones, and end the thread."""
        with self._ready:
            self._stopped = True
            queued = [j for j in self._jobs if j is not None]
            self._jobs.clear()
            self._jobs.append(None)
            self._ready.notify()
        for job in queued:
            job.cancel()
            _tell(job, ClientGone("the server is shutting down"))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def available(self) -> bool:
        """A job submitted now would run: not stopped, and the thread running or yet to start."""
        return not self._stopped and (self._thread is None or self._thread.is_alive())

    @property
    def depth(self) -> int:
        """Jobs waiting whose clients are still there (the running one not counted)."""
        with self._ready:
            return sum(1 for j in self._jobs if j is not None and not j.cancelled)

    def submit(self, run: Callable[[Job], Any]) -> Job:
        self.start()
        if not self.alive:
            raise EngineStopped("the engine worker's thread has ended; restart the server")
        job = Job(run)
        with self._ready:
            self._refuse_if_stopped()  # stopped since start() above
            left = [j for j in self._jobs if j is not None and j.cancelled]
            if left:  # clients that left while they waited: their places go to the ones still here
                self._jobs = collections.deque(j for j in self._jobs if j is None or not j.cancelled)
            waiting = sum(1 for j in self._jobs if j is not None)
            if waiting < self.max_queue:
                self._jobs.append(job)
                self._ready.notify()
        for j in left:
            _tell(j, ClientGone("the client disconnected before its turn"))
        if waiting >= self.max_queue:
            raise QueueFull(f"{waiting} requests are already waiting (--max-queue {self.max_queue}); retry later")
        return job

    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._jobs:
                    self._ready.wait()
                job = self._jobs.popleft()
            if job is None:
                return
            if job.cancelled:  # its client left while it waited
                _tell(job, ClientGone("the client disconnected before its turn"))
                continue
            if not job.future.set_running_or_notify_cancel():  # its future was cancelled: nobody waits for it
                continue
            self.running = True
            try:
                result = job.run(job)
            except BaseException as e:  # noqa: BLE001 - handed to the request; the worker goes on
                if not isinstance(e, (ClientGone, Exception)):
                    log.error("engine job ended by %r", e)
                job.future.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            else:
                job.future.set_result(result)
            finally:
                self.running = False
