"""Which backend runs: the one named (--backend), else the available one of highest declared priority; and the
Backend contract's declared defaults."""

import pytest

from cvllm import plugins
from cvllm.backends import cpu_kernels
from cvllm.backends.base import Backend
from cvllm.backends.cpu import CpuBackend
from cvllm.backends.selection import select_backend
from cvllm.plugins import RegistryError
from cvllm.testing.plugins import registers

pytestmark = pytest.mark.usefixtures("only_builtin_plugins")


class FastBackend(CpuBackend):
    name = "fast"
    priority = 50


class FasterButAbsent(CpuBackend):
    name = "absent"
    priority = 200

    @classmethod
    def is_available(cls) -> bool:
        return False


class SlowBackend(CpuBackend):
    name = "slow"
    priority = -10


def test_the_cpu_backend_runs_when_it_is_all_there_is():
    assert type(select_backend(None)) is CpuBackend


def test_the_available_backend_of_highest_priority_wins(add_plugin):
    add_plugin(registers("register_backends", ("absent", FasterButAbsent), ("fast", FastBackend),
                         ("slow", SlowBackend)), "more")
    assert type(select_backend(None)) is FastBackend   # absent's 200 is skipped: it is not available
    assert type(select_backend("slow")) is SlowBackend   # a name wins over priority
    assert type(select_backend("cpu")) is CpuBackend


def test_names_and_priorities_come_from_the_backends_not_from_a_list(add_plugin):
    class Metal(CpuBackend):   # a made-up name: nothing in core knows it
        name = "zz-metal"
        priority = 1

    add_plugin(registers("register_backends", ("zz-metal", Metal)), "apple")
    assert type(select_backend(None)) is Metal


def test_a_named_backend_must_be_available_and_registered(add_plugin):
    add_plugin(registers("register_backends", ("absent", FasterButAbsent)), "more")
    with pytest.raises(RuntimeError, match="backend 'absent' is installed but not available on this machine"):
        select_backend("absent")
    with pytest.raises(RegistryError, match=r"unknown backend 'tpu'; registered: absent, cpu"):
        select_backend("tpu")


def test_the_device_is_bound_before_the_backend_is_built(add_plugin):
    """--d 2: the backend class binds device 2 (CUDA: torch.cuda.set_device) before its constructor reads it."""
    events = []

    class Devices(CpuBackend):
        name = "devices"
        priority = 60

        @classmethod
        def bind_device(cls, index: int) -> None:
            events.append(("bind", index))

        def __init__(self) -> None:
            events.append(("build", None))

    add_plugin(registers("register_backends", ("devices", Devices)), "more")
    select_backend(None, device=2)
    select_backend("devices")   # no device asked for: the backend's default, nothing bound
    assert events == [("bind", 2), ("build", None), ("build", None)]


def test_a_backend_plugin_that_cannot_be_imported_is_skipped(add_plugin, caplog):
    add_plugin(registers("register_backends", ("broken", "cvllm_no_such_module:Backend")), "broken")
    assert type(select_backend(None)) is CpuBackend
    assert "backend 'broken' is skipped" in caplog.text


def test_the_contract_declares_its_defaults():
    backend = CpuBackend()
    assert (backend.priority, backend.default_max_num_seqs, backend.default_max_num_batched_tokens) == (0, 16, 2048)
    assert backend.default_async_scheduling is False and backend.sync_free_decode is False
    assert backend.wrap_decode(lambda *args: None, 4, 4) is None   # no graphs: decode steps run eagerly
    assert backend.default_kv_cache_bytes(10 << 30) == 4 << 30 and backend.default_kv_cache_bytes(2 << 30) == 1 << 30
    assert Backend().default_kv_cache_bytes(1000) == 900
    assert all(getattr(backend, kernel) is None for kernel in ("argmax", "linear", "rotary_write_kv", "silu_and_mul"))
    # the rotary and the add + RMSNorm are small C kernels where a C compiler built them (cpu_kernels.py; the norm
    # also only where it is bit-equal to torch's here), else the layers' torch code
    assert (backend.rotary is not None) == (cpu_kernels.load() is not None)
    assert (backend.fused_add_rms_norm is not None) == (cpu_kernels.load() is not None)


def test_collectives_are_identities_at_world_size_one():
    import torch

    backend, x = CpuBackend(), torch.arange(6.0).view(2, 3)
    assert backend.all_reduce(x) is x and backend.all_gather(x) is x and backend.broadcast(x) is x
    CpuBackend.bind_device(3)   # the CPU is one device every rank shares: any index, nothing to do
    assert x.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_the_contract_is_declared_on_backend():
    # what the engine and the layers read is declared on Backend, so they read it without getattr defaults
    declared = set(vars(Backend))
    for name in ("priority", "default_max_num_seqs", "default_max_num_batched_tokens", "default_async_scheduling",
                 "host_threads", "sync_free_decode", "prepare", "wrap_decode", "default_kv_cache_bytes",
                 "all_reduce", "all_gather", "broadcast", "bind_device"):
        assert name in declared, name
    assert plugins.backends().names() == ["cpu"]
