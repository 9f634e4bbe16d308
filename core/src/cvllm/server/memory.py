"""The API process gives back the memory its traffic used (issue 23's soak: RSS back to its baseline).

What traffic leaves behind in this process is garbage that waits, not objects that live on. Every HTTP connection's
objects (hypercorn's TCPServer, its h11 connection, task groups, stream reader and writer, transport, socket: ~41
container objects, measured, and their buffers) refer to each other, and a connection lives long enough for them to
reach the collector's oldest generation, so only a full collection frees them. CPython starts one by counts of
objects, not bytes: in the soak about every 1,250 requests (100-180 s), finding 8,000-32,000 objects each time and
taking 0.1-0.6 s, most of it traversing the ~186,000 objects of the start-up (imports, the tokenizer). The garbage
between two full collections sets pymalloc's high-water mark, and its 1 MiB arenas go back to the OS only when
wholly empty: the growth seen was new anonymous mappings of 2-8 MiB (arenas) while the live objects stayed flat.

So: ``freeze_startup_objects`` moves the start-up objects out of the collector's reach for good (gc.freeze: they are
never garbage), so a full collection traverses only what the traffic made; while the server works,
``release_memory_loop`` runs one every ``BUSY_COLLECT_S`` seconds (2-7 ms each in the soak), so the garbage peak is
that long's; and once the server has been idle past the keep-alive timeout (when the last connections have closed
and are garbage too), it collects and hands the free heap back to the OS (glibc's malloc_trim). Measured in the
10-minute soak (docs/benchmarks.md): the API process's RSS within 0.2 MB of its baseline through the soak, against
+3.8 MB without these.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import time

logger = logging.getLogger("cvllm.server")

POLL_S = 1.0
BUSY_COLLECT_S = 10.0   # while serving, a full collection this often: the garbage peak is 10 s's, not 1,250 requests'


def freeze_startup_objects() -> None:
    """Collect the start-up's garbage, then keep everything alive now out of future collections."""
    gc.collect()
    gc.freeze()


def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(None).malloc_trim   # the C library this process already has loaded
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _malloc_trim()


def release_memory() -> tuple[int, float]:
    """A full collection, then the free heap back to the OS; the objects collected and the seconds it took."""
    started = time.perf_counter()
    collected = gc.collect()
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)
    return collected, time.perf_counter() - started


async def release_memory_loop(state, idle_s: float, poll_s: float = POLL_S,
                              busy_every_s: float = BUSY_COLLECT_S) -> None:
    """Forever: while the engine works, a full collection every ``busy_every_s`` seconds (the garbage of the
    connections closed meanwhile); once it has had no request in flight and taken no step for ``idle_s`` seconds,
    ``release_memory`` (once per idle spell)."""
    last_seen, active_at, collected_at, released = None, time.monotonic(), time.monotonic(), True
    longest = 0.0
    while True:
        await asyncio.sleep(poll_s)
        client = state.client
        if client is None:
            continue
        seen = (id(client), client.stats.steps)
        now = time.monotonic()
        if client.num_in_flight or seen != last_seen:
            last_seen, active_at, released = seen, now, False
            if now - collected_at >= busy_every_s:
                started = time.perf_counter()
                gc.collect()
                longest = max(longest, time.perf_counter() - started)
                collected_at = now
        elif not released and now - active_at >= idle_s:
            released, collected_at = True, now
            collected, took = release_memory()
            logger.debug("idle for %.0f s: collected %d objects and trimmed the heap in %.3f s (busy: collections "
                         "every %g s, the longest %.3f s)", now - active_at, collected, took, busy_every_s, longest)
            longest = 0.0
