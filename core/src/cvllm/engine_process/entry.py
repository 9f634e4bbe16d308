"""The engine core process's entry point, in a module that imports nothing heavy.

The API process names ``run_core`` as the spawned process's target, so it imports this module; the child imports
torch, the engine and the plugins when it starts running. The API process thus launches the core before its own
torch import (seconds on a GPU machine), and both import side by side.
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cvllm.engine.config import EngineConfig


def run_core(config: EngineConfig, commands: Connection, outputs: Connection, log_level: int = logging.INFO) -> None:
    from cvllm.engine_process.process import run_core as run

    run(config, commands, outputs, log_level)
