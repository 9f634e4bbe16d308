"""The API process's release of memory (server/memory.py): full collections every ``busy_every_s`` while it works;
once per idle spell, only after ``idle_s`` without a request in flight or an engine step, a collection and a trim of
the heap; a full collection frees connection-like reference cycles; start-up objects are frozen out of collections."""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace

from cvllm.server import memory


class Client:
    def __init__(self):
        self.num_in_flight, self.stats = 0, SimpleNamespace(steps=0)


def test_the_idle_server_releases_once_per_idle_spell_and_collects_while_busy(monkeypatch):
    releases, collections = [], []
    monkeypatch.setattr(memory, "release_memory", lambda: releases.append(len(releases)) or (0, 0.0))
    monkeypatch.setattr(gc, "collect", lambda: collections.append(len(collections)) or 0)

    async def scenario():
        state = SimpleNamespace(client=Client())
        task = asyncio.create_task(memory.release_memory_loop(state, idle_s=0.05, poll_s=0.01, busy_every_s=0.1))
        await asyncio.sleep(0.2)
        assert len(releases) == 1                       # idle after start-up: once, not on every poll
        state.client.num_in_flight = 1                  # work: nothing is released while a request is in flight,
        collections.clear()
        await asyncio.sleep(0.35)
        assert len(releases) == 1 and 2 <= len(collections) <= 4   # but the garbage is collected every busy_every_s
        state.client.num_in_flight, state.client.stats.steps = 0, 7
        await asyncio.sleep(0.2)
        assert len(releases) == 2                       # idle again: once more
        state.client = Client()                         # a new core (a restart) is activity too
        await asyncio.sleep(0.2)
        assert len(releases) == 3
        task.cancel()

    asyncio.run(scenario())


def test_release_collects_reference_cycles_and_freezing_keeps_start_up_objects_out():
    class Connection:   # like hypercorn's: its parts refer to each other, so only the cycle collector frees them
        def __init__(self):
            self.protocol = SimpleNamespace(send=self.send, buffer=bytearray(1 << 16))

        def send(self):
            pass

    gc.disable()
    try:
        for _ in range(100):
            Connection()
        collected, took = memory.release_memory()
        assert collected >= 100 * 3 and took >= 0
        before = gc.get_freeze_count()
        memory.freeze_startup_objects()
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()
        gc.enable()
