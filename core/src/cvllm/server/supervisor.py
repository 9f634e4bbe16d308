"""Keeps an engine core running: when it dies (killed, a device error, a crash), the server starts a new one with
the same configuration instead of answering 503 forever, and gives up, so that the server exits non-zero and a
process supervisor takes over, after ``--max-restarts`` restarts within ten minutes.

Requests in flight when a core dies get an error (a stream gets an error event); /health answers 503 while the new
core loads, then 200 again. (Resuming those requests on the new core is issue 23's next step.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from cvllm.engine_process.client import EngineCoreClient, EngineStartupError

logger = logging.getLogger("cvllm.server")

RESTART_WINDOW_S = 600.0


async def supervise(state, args, stop: asyncio.Event) -> None:
    """Run beside the server until ``stop``; ``state.client`` is replaced by each new core. Sets
    ``state.gave_up`` and ``stop`` when it will not restart any more."""
    restarts: deque[float] = deque()
    while True:
        client = state.client
        await client.wait_exited()
        if client.closing or stop.is_set():
            return
        now = time.monotonic()
        while restarts and now - restarts[0] > RESTART_WINDOW_S:
            restarts.popleft()
        if len(restarts) >= args.max_restarts:
            state.gave_up = (f"the engine core died ({client.dead}) after {len(restarts)} restart(s) within "
                             f"{RESTART_WINDOW_S / 60:g} minutes (--max-restarts {args.max_restarts}); giving up")
            logger.error("%s", state.gave_up)
            stop.set()
            return
        restarts.append(now)
        logger.warning("the engine core died (%s); starting a new one (restart %d of at most %d in %g minutes)",
                       client.dead, len(restarts), args.max_restarts, RESTART_WINDOW_S / 60)
        state.restarting = True
        started = time.perf_counter()
        try:
            await client.shutdown()   # reaps it and closes its pipes (it is dead already)
            state.client = await EngineCoreClient.launch(args.engine).ready(args.startup_timeout)
        except EngineStartupError as e:
            state.gave_up = f"the engine core could not be restarted: {e}"
            logger.error("%s", state.gave_up)
            stop.set()
            return
        finally:
            state.restarting = False
        logger.info("engine core restarted in %.1f s (pid %s)", time.perf_counter() - started, state.client.pid)
