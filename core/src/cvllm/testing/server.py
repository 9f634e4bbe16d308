"""A real server in a subprocess, for tests and benchmarks: free port on 127.0.0.1, wait for /health,
stop by pid (SIGTERM, then SIGKILL if it hangs)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

# The start of a child server's code: if the test runner dies without stopping it, the server notices its parent
# is gone and stops itself, so no server outlives the tests.
PARENT_WATCH = """
import os, signal, threading, time
parent = os.getppid()
def watch_parent():
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=watch_parent, daemon=True).start()
"""
# Runs in the child: ServerArgs from JSON, then serve() and its exit code.
_BOOT = PARENT_WATCH + """
import json, logging, sys
from cvllm.engine.config import EngineConfig
from cvllm.server.args import ServerArgs
from cvllm.server.run import serve
spec = json.loads(sys.argv[1])
if spec["engine"].get("fault_injector"):   # a fault plan, as a list of Fault fields (cvllm.testing.faults)
    from cvllm.testing.faults import FaultPlan
    spec["engine"]["fault_injector"] = FaultPlan.of(*spec["engine"]["fault_injector"])
logging.basicConfig(level=str(spec.pop("log_level", "INFO")).upper(),
                    format="%(asctime)s %(levelname)s %(name)s: %(message)s")
args = ServerArgs(engine=EngineConfig(**spec.pop("engine")), **spec)
sys.exit(serve(args))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    def __init__(self, engine: dict[str, Any], **server: Any):
        self.port = server.setdefault("port", free_port())
        server.setdefault("host", "127.0.0.1")
        self.spec = {"engine": engine, **server}
        self.process: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="cvllm-server-", suffix=".log", delete=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> LiveServer:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        # its own session: a signal meant for the test runner's group does not reach it, and ours reach only it
        self.process = subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps(self.spec)], env=env,
                                        stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            if self.health() == 200:
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the server was not healthy within {timeout} s:\n{self.log()}")

    def health(self) -> int | None:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait for the graceful exit; the exit code (None if it had to be killed)."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)   # its session: the server and its engine core
            self.process.wait()
            return None

    def log(self) -> str:
        self._log.flush()
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def __enter__(self) -> LiveServer:
        return self.start()

    def close(self) -> None:
        """Stop the server (if running) and delete its log."""
        self.stop()
        self._log.close()
        if os.path.exists(self._log.name):
            os.unlink(self._log.name)

    def __exit__(self, *exc: object) -> None:
        self.close()
