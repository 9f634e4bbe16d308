"""Which backend runs the engine: the one the user names, else the available one of highest priority."""

from __future__ import annotations

import logging

from cvllm import plugins
from cvllm.backends.base import Backend

logger = logging.getLogger(__name__)


def select_backend(name: str | None = None, device: int | None = None) -> Backend:
    """An instance of the backend ``name`` (``--backend``), which must be available here; without a name, of the
    available backend of highest ``priority`` (ties: the first name in sorted order). ``device``: the device index
    it runs on (``Backend.bind_device``); None: the backend's default."""
    backend_class = _backend_class(name)
    if device is not None:
        backend_class.bind_device(device)
    return backend_class()


def _backend_class(name: str | None) -> type[Backend]:
    registry = plugins.backends()
    if name is not None:
        backend_class = registry.get(name)   # an unknown name is a RegistryError listing the registered ones
        if not backend_class.is_available():
            raise RuntimeError(f"backend '{name}' is installed but not available on this machine")
        return backend_class
    candidates: list[type[Backend]] = []
    for candidate in registry.names():
        try:
            candidates.append(registry.get(candidate))
        except ImportError as e:   # one broken backend plugin must not stop the others
            logger.warning("backend %r is skipped: %s", candidate, e)
    for backend_class in sorted(candidates, key=lambda c: -c.priority):
        if backend_class.is_available():
            return backend_class
    raise RuntimeError(f"no backend is available on this machine; registered: {', '.join(registry.names())}")
