"""Name registries: what the ``register_*`` hooks filled, resolved to objects on first use.

Nothing here knows about pluggy. A ``Registry`` is built from a list of ``Registration``s (plugin,
name, target); targets are usually lazy ``"module:Attribute"`` strings that ``load_target``
imports only when the name is first looked up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import import_module


class RegistryError(ValueError):
    """A name is unknown, registered twice, or registered with a malformed target."""


def load_target(spec: str | object) -> object:
    """Import ``"package.module:Attribute"`` (the attribute may be dotted); a non-string is
    already the object and is returned as is."""
    if not isinstance(spec, str):
        return spec
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"bad target {spec!r}: expected 'package.module:Attribute'")
    try:
        obj: object = import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"cannot import {spec!r}: {exc}") from exc
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise ImportError(f"cannot import {spec!r}: module {module_name!r} has no attribute "
                              f"{attr_path!r}") from None
    return obj


def target_name(target: str | object) -> str:
    """A registered target as the ``"module:Attribute"`` text shown to users."""
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or "?"
    return f"{module}:{getattr(target, '__qualname__', repr(target))}"


@dataclass(slots=True, frozen=True)
class Registration:
    """One ``register(name, target)`` call, attributed to the plugin that made it."""

    plugin: str
    name: str
    target: str | object


@dataclass(slots=True, frozen=True)
class _Entry:
    target: str | object
    owner: str


class Registry:
    """Names registered through one ``register_*`` hook, e.g. every architecture."""

    def __init__(self, kind: str, registrations: Sequence[Registration]) -> None:
        self.kind = kind
        self._entries: dict[str, _Entry] = {}
        self._loaded: dict[str, object] = {}
        for reg in registrations:
            if reg.name in self._entries:
                first = self._entries[reg.name].owner
                raise RegistryError(
                    f"{self._label} {reg.name!r} is registered twice: by plugin {first!r} and by plugin "
                    f"{reg.plugin!r} (uninstall one of them, or leave one out of CVLLM_PLUGINS)")
            self._entries[reg.name] = _Entry(reg.target, reg.plugin)

    @property
    def _label(self) -> str:
        return self.kind.replace("_", " ")

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> object:
        """The registered object, imported on first use and cached."""
        if name not in self._loaded:
            entry = self._entry(name)
            try:
                self._loaded[name] = load_target(entry.target)
            except ImportError as exc:
                raise ImportError(f"{self._label} {name!r} from plugin {entry.owner!r} cannot be loaded: "
                                  f"{exc}") from exc
        return self._loaded[name]

    def spec(self, name: str) -> str | object:
        """The raw target as registered, usually ``"module:Class"`` (what TP workers are sent)."""
        return self._entry(name).target

    def owner(self, name: str) -> str:
        return self._entry(name).owner

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()!r})"

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            registered = ", ".join(self.names()) or "none"
            raise RegistryError(f"unknown {self._label} {name!r}; registered: {registered} "
                                "(install a plugin that provides it)") from None
