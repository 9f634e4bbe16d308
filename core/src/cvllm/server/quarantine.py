"""The poison rule's suspects, retried one at a time (server/supervisor.py).

A request in flight each time two engine cores in a row died may be what brings them down, or may only have been
beside the one that does: the deaths alone cannot tell. When one request alone was in flight through both, it is
failed at once (nothing to tell apart). When several were, none is failed yet: they wait here, their clients seeing
a pause, and are resumed one at a time, in the order they arrived, the next once the one before has ended. Beside
the suspect on trial run the requests that were in flight at the last death only and the new ones the server takes
meanwhile; no other suspect. If the core dies with a suspect on trial, that suspect is failed (resume_held) and the
others go on waiting their turn; the bystanders finish as they would have without the deaths.

The price: a request that brings down every core it reaches, when others were in flight with it, costs three core
deaths and restarts (of ``--max-restarts``) instead of two, and the suspects after it wait for its trial.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterable

from cvllm.engine_process.stream import EngineDeadError, RequestError, RequestStream


class Quarantine:
    """Suspects waiting for their trial, and the one on trial."""

    def __init__(self, current_core: Callable[[], object]):
        """``current_core``: the client of the engine core running now (the server's state.client)."""
        self._current_core = current_core
        self.waiting: deque[RequestStream] = deque()
        self.on_trial: RequestStream | None = None

    def __len__(self) -> int:
        return len(self.waiting) + (self.on_trial is not None)

    def add(self, suspects: Iterable[RequestStream]) -> None:
        for stream in suspects:
            stream._client = self   # a client that leaves while it waits aborts it here (``abort``)
            self.waiting.append(stream)

    def next_trial(self) -> None:
        """Resume the next suspect on the current core unless one is on trial; when the core is dead (a new one
        is loading), the supervisor calls this again once the new core is up."""
        while self.on_trial is None and self.waiting:
            stream = self.waiting.popleft()
            try:
                self._current_core().resume(stream)
            except EngineDeadError:
                stream._client = self
                self.waiting.appendleft(stream)
                return
            self.on_trial = stream
            stream.on_end = self._trial_ended

    def blame(self, held: list[RequestStream]) -> RequestStream | None:
        """The suspect on trial if it was among the dead core's ``held`` requests: the core died with it once more.
        It is no longer on trial (the caller fails it)."""
        stream = self.on_trial
        if stream is None or not any(s is stream for s in held):
            return None
        stream.on_end, self.on_trial = None, None
        return stream

    def fail_all(self, error: RequestError) -> None:
        """The server stops restarting cores: the suspects still waiting end with ``error``."""
        waiting, self.waiting = self.waiting, deque()
        for stream in waiting:
            stream.fail(error)

    def abort(self, request_id: str, indices: Collection[int] | None = None) -> None:
        """A waiting suspect's client left (or a stop string ended some of its completions): as the core's client
        would, stop it, or only those completions (a resumed request then continues only the others)."""
        stream = next((s for s in self.waiting if s.request_id == request_id), None)
        if stream is None:
            return
        if indices is not None:
            stream._unfinished.difference_update(indices)
        if indices is None or not stream._unfinished:
            self.waiting.remove(stream)
            stream._stop()

    def _trial_ended(self) -> None:
        """The suspect on trial finished, failed or was aborted: the next one's turn."""
        self.on_trial = None
        self.next_trial()
