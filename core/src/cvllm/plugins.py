"""Plugin discovery (one pluggy manager, entry-point group ``cvllm``) and the per-kind registries
(``architectures()``, ``backends()``, ...) that the ``register_*`` hooks fill.

Registrations are lazy ``"module:Attribute"`` strings: building a registry imports nothing, and
``Registry.get`` imports a target only when it is first used. The ``Registry`` class itself is in
``cvllm.registry``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from importlib import metadata

import pluggy

from cvllm import builtin_plugin, hookspecs

# The registries live in cvllm.registry; their names are re-exported here, where callers found them
# before the split (``from cvllm.plugins import RegistryError, load_target``).
from cvllm.registry import Registration, Registry, RegistryError, load_target, target_name

__all__ = [
    "BUILTIN_PLUGIN_NAME", "ENTRY_POINT_GROUP", "REGISTRY_HOOKS", "Registration", "Registry", "RegistryError",
    "architectures", "backends", "get_plugin_manager", "gguf_architectures", "load_target", "logits_processors",
    "open_checkpoint", "plugin_report", "quantizers", "registry_problems", "reset_plugins", "target_name",
    "tool_parsers",
]

logger = logging.getLogger(__name__)
trace_logger = logging.getLogger(__name__ + ".trace")

ENTRY_POINT_GROUP = "cvllm"
BUILTIN_PLUGIN_NAME = "builtin"

# Registry kind -> the hook that fills it.
REGISTRY_HOOKS: dict[str, str] = {
    "architecture": "register_architectures",
    "backend": "register_backends",
    "quantizer": "register_quantizers",
    "logits_processor": "register_samplers",
    "gguf_architecture": "register_gguf_architectures",
    "converter": "register_converters",
    "tool_parser": "register_tool_parsers",
}


class _PluginManager(pluggy.PluginManager):
    """pluggy's manager plus what cvllm learns while loading plugins. Registries are cached on it
    and dropped whenever a plugin is registered or unregistered, so they never go stale."""

    def __init__(self) -> None:
        super().__init__(ENTRY_POINT_GROUP)
        self.distributions: dict[str, tuple[str, str]] = {}  # entry-point name -> (dist, version)
        self.load_errors: dict[str, str] = {}  # entry-point name -> why it did not load
        self.registries: dict[str, Registry] = {}

    def register(self, plugin: object, name: str | None = None) -> str | None:
        plugin_name = super().register(plugin, name)
        self.registries.clear()
        self._reject_unknown_hooks(plugin)
        return plugin_name

    def _reject_unknown_hooks(self, plugin: object) -> None:
        """pluggy reports a misspelled hook only at check_pending(), for all plugins at once; catch
        it at registration instead, so it names the one plugin at fault and leaves the others usable."""
        unknown = sorted(
            caller.name for caller in self.get_hookcallers(plugin) or []
            if not caller.has_spec()
            and not any(impl.optionalhook for impl in caller.get_hookimpls() if impl.plugin is plugin)
        )
        if unknown:
            self.unregister(plugin)
            known = sorted(name for name in dir(hookspecs) if hasattr(getattr(hookspecs, name), "cvllm_spec"))
            raise pluggy.PluginValidationError(
                plugin, f"unknown hook(s) {', '.join(unknown)}; cvllm hooks are {', '.join(known)}")

    def unregister(self, plugin: object | None = None, name: str | None = None) -> object | None:
        removed = super().unregister(plugin, name)
        self.registries.clear()
        return removed


_manager: _PluginManager | None = None


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created (and entry points loaded) on first use."""
    return _get_manager()


def reset_plugins() -> None:
    """Forget the manager and every cached registry; the next call rediscovers plugins."""
    global _manager
    _manager = None


def _get_manager() -> _PluginManager:
    global _manager
    if _manager is None:
        _manager = _create_manager()
    return _manager


def _create_manager() -> _PluginManager:
    pm = _PluginManager()
    pm.add_hookspecs(hookspecs)
    if os.environ.get("CVLLM_TRACE_HOOKS", "") not in ("", "0"):
        _trace_hook_calls(pm)
    pm.register(builtin_plugin, name=BUILTIN_PLUGIN_NAME)
    _load_entry_points(pm)
    pm.check_pending()
    return pm


def _allowlist() -> set[str] | None:
    value = os.environ.get("CVLLM_PLUGINS")
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def _load_entry_points(pm: _PluginManager) -> None:
    allowed = _allowlist()
    seen: set[str] = set()
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        seen.add(ep.name)
        if allowed is not None and ep.name not in allowed:
            continue
        dist = getattr(ep, "dist", None)
        if dist is not None:
            pm.distributions[ep.name] = (dist.name, dist.version)
        try:
            module = ep.load()
            pm.register(module, name=ep.name)
        except Exception as exc:  # one broken plugin must not take the others down
            pm.load_errors[ep.name] = f"{type(exc).__name__}: {exc}"
            logger.warning("cvllm plugin %r (%s) failed to load and is skipped: %s",
                           ep.name, ep.value, pm.load_errors[ep.name])
    if allowed is not None and allowed - seen - {BUILTIN_PLUGIN_NAME}:
        logger.warning("CVLLM_PLUGINS names %s, but no installed plugin has that name",
                       ", ".join(sorted(allowed - seen - {BUILTIN_PLUGIN_NAME})))


def _trace_hook_calls(pm: _PluginManager) -> None:
    # The user asked for the trace explicitly, so make sure it is shown even if nobody configured logging.
    if not trace_logger.hasHandlers():
        trace_logger.addHandler(logging.StreamHandler())
    if trace_logger.getEffectiveLevel() > logging.INFO:
        trace_logger.setLevel(logging.INFO)

    def before(hook_name: str, hook_impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, object]) -> None:
        args = ", ".join(f"{key}={value!r}" for key, value in kwargs.items())
        plugins = ", ".join(impl.plugin_name for impl in hook_impls)
        trace_logger.info("hook %s(%s) -> plugins [%s]", hook_name, args, plugins)

    def after(outcome: pluggy.Result, hook_name: str, hook_impls: Sequence[pluggy.HookImpl],
              kwargs: Mapping[str, object]) -> None:
        if outcome.exception is not None:
            trace_logger.info("hook %s raised %r", hook_name, outcome.exception)
        else:
            trace_logger.info("hook %s returned %r", hook_name, outcome.get_result())

    pm.add_hookcall_monitoring(before, after)


class _Registrar:
    """The ``register(name, target)`` callback handed to one plugin's ``register_*`` hook."""

    __slots__ = ("hook_name", "plugin_name", "registrations")

    def __init__(self, hook_name: str, plugin_name: str, registrations: list[Registration]) -> None:
        self.hook_name = hook_name
        self.plugin_name = plugin_name
        self.registrations = registrations

    def __call__(self, name: str, target: str | object) -> None:
        where = f"plugin {self.plugin_name!r} ({self.hook_name})"
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{where} registered the name {name!r}; names are non-empty strings")
        if isinstance(target, str) and not all(target.partition(":")[::2]):
            raise RegistryError(
                f"{where} registered {name!r} as {target!r}; expected 'package.module:Attribute'")
        if target is None:
            raise RegistryError(f"{where} registered {name!r} with no target")
        self.registrations.append(Registration(self.plugin_name, name, target))

    def __repr__(self) -> str:
        return f"<register for plugin {self.plugin_name!r}>"


def _collect_registrations(pm: _PluginManager, hook_name: str) -> list[Registration]:
    """Call each implementation of ``hook_name`` on its own, so every registration is attributed to
    the plugin that made it. Calls go through pluggy (not impl.function) so tracing sees them."""
    registrations: list[Registration] = []
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        others = [plugin for plugin in pm.get_plugins() if plugin is not impl.plugin]
        call_one = pm.subset_hook_caller(hook_name, remove_plugins=others)
        call_one(register=_Registrar(hook_name, impl.plugin_name, registrations))
    return registrations


def _registry(kind: str) -> Registry:
    pm = _get_manager()
    if kind not in pm.registries:
        pm.registries[kind] = Registry(kind, _collect_registrations(pm, REGISTRY_HOOKS[kind]))
    return pm.registries[kind]


def architectures() -> Registry:
    return _registry("architecture")


def backends() -> Registry:
    return _registry("backend")


def quantizers() -> Registry:
    return _registry("quantizer")


def logits_processors() -> Registry:
    """Named logits processors (``cvllm.engine.logits_processors.LogitsProcessor`` classes) that requests ask for."""
    return _registry("logits_processor")


def gguf_architectures() -> Registry:
    return _registry("gguf_architecture")


def tool_parsers() -> Registry:
    """Tool-call parsers for ``--tool-call-parser NAME`` (``target()`` -> a parser; cvllm/server/tool_calls.py)."""
    return _registry("tool_parser")


def converters() -> Registry:
    """Checkpoint converters for ``cvllm convert --to NAME`` (``target(src, out, options)``)."""
    return _registry("converter")


def registry_problems() -> list[str]:
    """Why any registry cannot be built (duplicate names, malformed targets); empty when all is well."""
    problems = []
    for kind in REGISTRY_HOOKS:
        try:
            _registry(kind)
        except RegistryError as exc:
            problems.append(str(exc))
    return problems


def open_checkpoint(path: str | os.PathLike[str]) -> object:
    """Ask the plugins, in order, to open ``path``; the first that recognises it wins."""
    path = os.fspath(path)
    pm = _get_manager()
    checkpoint = pm.hook.open_checkpoint(path=path)
    if checkpoint is not None:
        return checkpoint
    if not os.path.exists(path):
        raise FileNotFoundError(f"no plugin can open {path!r}: no such file or directory")
    readers = ", ".join(impl.plugin_name for impl in pm.hook.open_checkpoint.get_hookimpls())
    hint = " (.gguf files need the cvllm-gguf plugin)" if path.endswith(".gguf") else ""
    raise ValueError(f"no plugin can open {path!r}; checkpoint readers installed: {readers}{hint}")


def plugin_report() -> list[dict]:
    """Per plugin: its name, distribution and version (for entry-point plugins), the hooks it
    implements, what it registered per hook, and the error if it failed to load."""
    pm = _get_manager()
    plugins = [(name, plugin) for name, plugin in pm.list_name_plugin() if plugin is not None]
    registered: dict[str, dict[str, dict[str, str]]] = {name: {} for name, _ in plugins}
    for hook_name in REGISTRY_HOOKS.values():
        for reg in _collect_registrations(pm, hook_name):
            registered[reg.plugin].setdefault(hook_name, {})[reg.name] = target_name(reg.target)
    report = []
    for name, plugin in plugins:
        hooks = sorted(caller.name for caller in pm.get_hookcallers(plugin) or [])
        report.append(_report_entry(pm, name, hooks, registered[name], error=None))
    for name, error in pm.load_errors.items():
        report.append(_report_entry(pm, name, [], {}, error=error))
    return report


def _report_entry(pm: _PluginManager, name: str, hooks: list[str],
                  registered: dict[str, dict[str, str]], error: str | None) -> dict:
    distribution, version = pm.distributions.get(name, (None, None))
    return {"name": name, "builtin": name == BUILTIN_PLUGIN_NAME, "distribution": distribution,
            "version": version, "hooks": hooks, "registered": registered, "error": error}
