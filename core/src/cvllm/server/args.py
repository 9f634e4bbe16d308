"""Everything ``cvserve`` needs to start, after its flags are parsed (see docs/cli.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cvllm.engine.config import EngineConfig


@dataclass
class ServerArgs:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 2000
    served_model_names: list[str] = field(default_factory=list)   # empty: the model path's last component
    strict_model_name: bool = False           # unknown 'model' names are a 404 (vLLM), not the served model
    api_key: str | None = None
    chat_template: str | None = None          # a file path or the template text; overrides the checkpoint's
    max_queue: int = 1024                     # waiting requests beyond the running ones before 429
    max_body_bytes: int = 16 << 20            # larger request bodies → 413
    cors_allow_origins: list[str] = field(default_factory=list)
    cors_allow_credentials: bool = False
    cors_allow_methods: list[str] = field(default_factory=lambda: ["*"])
    cors_allow_headers: list[str] = field(default_factory=lambda: ["*"])
    shutdown_timeout: float = 30.0            # seconds to finish in-flight requests after SIGTERM/Ctrl-C
    send_timeout: float = 60.0                # seconds a client may leave sent data unread: dropped (listen.py)
    default_sampling: dict[str, Any] = field(default_factory=dict)  # --temperature, --top-p ... (request wins)
    generation_config: str = "auto"           # "vllm": ignore the model's sampling defaults (--generation-config)
    reasoning_parser: str | None = None       # None: the model's own declaration, if any
    tool_call_parser: str | None = None       # None: the one the chat template's tool-call format calls for
    log_level: str = "info"
    startup_timeout: float | None = None      # seconds to wait for the engine core to load
    max_restarts: int = 3                     # engine-core restarts within 10 minutes before the server gives up
    engine_hang_timeout: float = 60.0         # seconds a working core may say nothing before it is restarted; 0: off
    ui: bool = True                           # the chat page (--no-ui: off)
    ui_port: int | None = None                # None: the page on the API's port; else its own (--ui-server)
    task: str = "auto"                        # --task: auto | generate | embed (cvllm/pooling.py)
