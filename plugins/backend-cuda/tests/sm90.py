"""Compiling a Triton kernel for Hopper (sm_90) without a GPU: Triton ships ptxas, so a CPU machine compiles what
the H200 would. Triton's interpreter (how CI runs the kernels) does not type-check a kernel, so a kernel can pass
every interpreter test and still fail to compile; a compile here catches that on CI. bench/sass_stats.py reads the
compiled kernel's registers, shared memory and SASS."""

from __future__ import annotations

import inspect
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.tensor_descriptor import TensorDescriptor


def compile_sm90(fn, signature: dict, constexprs: dict, warps: int, stages: int | None = None,
                 divisible: frozenset[str] = frozenset(), max_registers: int | None = None,
                 fp_fusion: bool | None = None):
    """``fn`` compiled for sm_90. ``signature``: the runtime arguments' Triton types (``"*bf16"``, ``"i32"``...);
    pointers and the ``divisible`` integers get the 16-divisibility a launch specialises them on;
    ``max_registers``: a launch's ``maxnreg``; ``fp_fusion``: its ``enable_fp_fusion`` (None: Triton's default)."""
    # in the kernel's parameter order, whatever order the caller listed them in (indices name the parameters)
    # constexprs the caller left out take the kernel's defaults (a switch added with a default keeps older callers)
    defaults = {name: param.default for name, param in inspect.signature(fn.fn).parameters.items()
                if param.default is not inspect.Parameter.empty and name not in signature}
    constexprs = {**defaults, **constexprs}
    given = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    missing = set(fn.arg_names) - set(given)
    assert not missing, f"no type or value for {sorted(missing)}"
    names = list(fn.arg_names)
    signature = {name: given[name] for name in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
             if t.startswith("*") or n in divisible}
    source = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                       attrs=attrs)
    options = {"num_warps": warps, **({"num_stages": stages} if stages else {}),
               **({"maxnreg": max_registers} if max_registers else {}),
               **({"enable_fp_fusion": fp_fusion} if fp_fusion is not None else {})}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv"}
OPTIONS = {"num_warps", "num_stages", "enable_fp_fusion", "launch_pdl", "num_ctas", "maxnreg"}


class LaunchRecorder:
    """Stands in for a ``@triton.jit`` kernel while its Python launcher runs on CPU tensors: ``kernel[grid](...)``
    records the launch's arguments instead of running it, for ``compile_launch``."""

    def __init__(self, fn):
        self.fn, self.launches = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def compile_launch(fn, args: tuple, kwargs: dict):
    """``fn`` compiled for sm_90 as a launch with these arguments would compile it on the GPU: the runtime
    arguments' types from the tensors and numbers, the constexprs as given or defaulted, and as Triton's launcher
    specialises them an integer equal to 1 as a constant and one divisible by 16 as such (not the kernel's
    ``do_not_specialize`` ones): a stride of 1 folds into the address arithmetic there, so it must here."""
    values = dict(zip(fn.arg_names, args)) | {k: v for k, v in kwargs.items() if k not in OPTIONS}
    signature, constexprs, divisible = {}, {}, set()
    for param in fn.params:
        name = param.name
        if param.is_constexpr:
            constexprs[name] = values[name] if name in values else param.default
            continue
        value = values[name]
        if value is None:   # (Triton's launcher makes a None argument a constant)
            constexprs[name] = None
        elif isinstance(value, TensorDescriptor):
            signature[name] = f"tensordesc<{TYPES[value.base.dtype]}" \
                              f"[{', '.join(map(str, value.block_shape))}]>"
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1 and not param.do_not_specialize:
            constexprs[name] = 1
        else:
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and not param.do_not_specialize:
                divisible.add(name)
    return compile_sm90(fn, signature, constexprs, kwargs.get("num_warps", 4), kwargs.get("num_stages"),
                        frozenset(divisible), kwargs.get("maxnreg"), kwargs.get("enable_fp_fusion"))


def tool(name: str) -> str:
    """The path of one of the CUDA tools Triton ships (nvdisasm, cuobjdump, ptxas)."""
    return str(Path(triton.__path__[0]) / "backends" / "nvidia" / "bin" / name)


def resource_usage(kernel) -> dict[str, int]:
    """A compiled kernel's resources as cuobjdump reads them from its cubin: REG (registers a thread), STACK (bytes
    a thread of local memory: register spills), SHARED ..."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
    return {key: int(value) for key, value in re.findall(r"([A-Z]+):(\d+)", usage.split("Function", 1)[-1])}


def registers(kernel) -> int:
    """Registers a thread of a compiled kernel uses."""
    return resource_usage(kernel)["REG"]


def sass(kernel) -> list[str]:
    """A compiled kernel's SASS instructions in order (opcode and operands, as cuobjdump prints them)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        dump = subprocess.run([tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    return [line.split("*/", 1)[1].split(";")[0].strip() for line in dump.splitlines()
            if re.match(r"\s*/\*[0-9a-f]{4}\*/", line)]


def unpredicated(kernel) -> list[str]:
    """``sass(kernel)`` with each instruction's predicate guard taken off (``@!P0 LDG...`` -> ``LDG...``), so that
    opcodes are matched at the start of the line whether guarded or not."""
    return [re.sub(r"^@!?U?P\w+\s+", "", line) for line in sass(kernel)]


def loads_before_wait(kernel) -> int:
    """Global loads (LDG) a compiled kernel issues before its one ``griddepcontrol.wait`` (SASS ACQBULK), the PDL
    wait: what it reads while the previous kernel may still be running (predicated ones too: ``@!P0 LDG...``)."""
    lines = unpredicated(kernel)
    [wait] = [i for i, line in enumerate(lines) if line.startswith("ACQBULK")]
    return sum(line.startswith("LDG") for line in lines[:wait])
