"""Keeps an engine core running: when it dies (killed, a device error, a crash) or hangs, the server starts a new one
with the same configuration instead of answering 503 forever, and gives up, so that the server exits non-zero and a
process supervisor takes over, after ``--max-restarts`` restarts within ten minutes.

Nothing in flight is lost: the dead core's client holds its requests' streams open (``hold_on_death``), and each is
resubmitted to the new core with the tokens its client already has, as output the new core continues (the client's
stream goes on where it stopped; greedy output is the same as without the failure), in the order they arrived. A
request that was in flight when two cores in a row died may be what kills them: alone, it is failed instead of being
resubmitted a third time; with others (bystanders, perhaps), each is retried alone (quarantine.py) and the one in
flight when a core dies once more is failed. Embedding requests in flight fail (the client retries them). /health
answers 503 while the new core loads, then 200 again.

A core that works (requests in flight) but has said nothing for ``--engine-hang-timeout`` seconds is hung: it is
killed (SIGKILL) and handled as one that died. A working core reports at least every second (process.py's
heartbeat), so only a step stuck far longer than any step takes trips this.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from cvllm.engine_process.client import EngineCoreClient, EngineDeadError, EngineStartupError, RequestError
from cvllm.engine_process.stream import RequestStream
from cvllm.server.quarantine import Quarantine

logger = logging.getLogger("cvllm.server")

RESTART_WINDOW_S = 600.0
POISON_DEATHS = 2   # a request in flight through this many core deaths is failed, not resubmitted again


async def supervise(state, args, stop: asyncio.Event) -> None:
    """Run beside the server until ``stop``; ``state.client`` is replaced by each new core. Sets
    ``state.gave_up`` and ``stop`` when it will not restart any more. After ``stop`` a core that dies is still
    replaced while requests wait for it, so that they drain."""
    quarantine = Quarantine(lambda: state.client)
    try:
        await _supervise(state, args, stop, quarantine)
    finally:   # no core will be started any more: the suspects still waiting for their trial cannot have one
        quarantine.fail_all(EngineDeadError(f"the engine core is not running: {state.gave_up or 'shutting down'}"))


async def _supervise(state, args, stop: asyncio.Event, quarantine: Quarantine) -> None:
    restarts: deque[float] = deque()
    while True:
        client = state.client
        client.hold_on_death = True
        await wait_for_end(client, args.engine_hang_timeout)
        if client.closing or (stop.is_set() and not client.num_in_flight and not quarantine.waiting):
            client.fail_held()
            return
        now = time.monotonic()
        while restarts and now - restarts[0] > RESTART_WINDOW_S:
            restarts.popleft()
        if len(restarts) >= args.max_restarts:
            state.gave_up = (f"the engine core died ({client.dead}) after {len(restarts)} restart(s) within "
                             f"{RESTART_WINDOW_S / 60:g} minutes (--max-restarts {args.max_restarts}); giving up")
            logger.error("%s", state.gave_up)
            client.fail_held()
            stop.set()
            return
        restarts.append(now)
        logger.warning("the engine core died (%s) after step %d with %d request(s) in flight; starting a new one "
                       "(restart %d of at most %d in %g minutes)", client.dead, client.stats.steps,
                       client.num_in_flight, len(restarts), args.max_restarts, RESTART_WINDOW_S / 60)
        state.restarting = True
        started = time.perf_counter()
        try:
            await client.shutdown()   # reaps it and closes its pipes (it is dead already); held streams stay open
            new = await EngineCoreClient.launch(args.engine).ready(args.startup_timeout)
        except EngineStartupError as e:
            state.gave_up = f"the engine core could not be restarted: {e}"
            logger.error("%s", state.gave_up)
            client.fail_held()
            stop.set()
            return
        except BaseException:   # cancelled (the server stops): the held requests end with the old core
            client.fail_held()
            raise
        finally:
            state.restarting = False
        new.hold_on_death = True
        state.client = new
        resumed = resume_held(client, new, quarantine)
        logger.info("engine core restarted in %.1f s (pid %s); %d request(s) resumed", time.perf_counter() - started,
                    new.pid, resumed)


async def wait_for_end(client: EngineCoreClient, hang_timeout: float) -> None:
    """Until the core has exited. With ``hang_timeout`` (seconds; 0: off), a core that has requests in flight and
    has said nothing for that long is killed first."""
    if not hang_timeout:
        await client.wait_exited()
        return
    poll = min(1.0, hang_timeout / 4)
    while True:
        try:
            await asyncio.wait_for(client.wait_exited(), poll)
            return
        except TimeoutError:
            pass
        silent = time.monotonic() - client.last_heard
        if client.dead is None and client.num_in_flight and silent > hang_timeout:
            reason = (f"it made no progress for {silent:.0f} s with {client.num_in_flight} request(s) in flight "
                      f"(last step {client.stats.steps}; --engine-hang-timeout {hang_timeout:g})")
            logger.error("the engine core (pid %s) is hung: %s; killing it", client.pid, reason)
            client.kill(f"hung: {reason}")
            await client.wait_exited()
            return


def resume_held(dead: EngineCoreClient, new: EngineCoreClient, quarantine: Quarantine | None = None) -> int:
    """Resubmit the requests the dead core held to the new one, in the order they arrived. Those that have now been
    in flight through ``POISON_DEATHS`` deaths are suspects: one alone is failed; several wait in ``quarantine`` to
    be retried one at a time (without one, all are failed). The suspect that was on trial is failed. Returns how
    many were resumed."""
    held = dead.take_held()
    for stream in held:
        stream.core_deaths += 1
    blamed = quarantine.blame(held) if quarantine is not None else None
    if blamed is not None:
        fail_poison(blamed, dead, "the last time retried as the only suspect")
    suspects = [s for s in held if s.core_deaths >= POISON_DEATHS and s is not blamed]
    if quarantine is not None and (len(suspects) > 1 or (suspects and blamed is not None)):
        logger.warning("requests %s were in flight when %d engine cores in a row died; retrying them one at a "
                       "time", ", ".join(s.request_id for s in suspects), POISON_DEATHS)
        quarantine.add(suspects)
    else:
        for stream in suspects:
            fail_poison(stream, dead)
    resumed = 0
    for stream in held:
        if stream is blamed or stream.core_deaths >= POISON_DEATHS:
            continue
        try:
            new.resume(stream)
            resumed += 1
        except EngineDeadError as e:   # the new core is gone already: its own death is the supervisor's next turn
            stream.fail(e)
    if quarantine is not None:
        quarantine.next_trial()
    return resumed


def fail_poison(stream: RequestStream, dead: EngineCoreClient, how: str = "") -> None:
    logger.error("request %s was in flight when %d engine cores in a row died%s; failing it instead of resubmitting "
                 "it", stream.request_id, stream.core_deaths, f", {how}" if how else "")
    stream.fail(RequestError(f"this request was in flight each time the engine core died, {stream.core_deaths} times "
                             f"in a row{f' ({how})' if how else ''} (last: {dead.dead}); it is not retried, as it may "
                             f"be what brings the core down"))
