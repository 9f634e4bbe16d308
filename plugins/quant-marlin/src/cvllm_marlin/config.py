"""``quantization_config`` (config.json) of GPTQ and AWQ checkpoints, parsed and checked.

Anything this plugin cannot load is refused here, before any weight is read, with the field named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class QuantConfigError(ValueError):
    """The checkpoint's quantization_config asks for something this plugin does not load."""


@dataclass(frozen=True, slots=True)
class GPTQConfig:
    bits: int             # 4 or 8
    group_size: int       # 128, 64, 32 ... or -1: one group over the whole input
    sym: bool
    desc_act: bool        # act-order: g_idx is a permutation-derived group map, not i // group_size
    zero_offset: int      # 1 for the v1 format ("zeros minus one" stored, AutoGPTQ), 0 for gptq_v2

    @property
    def pack(self) -> int:
        return 32 // self.bits


@dataclass(frozen=True, slots=True)
class AWQConfig:
    bits: int             # 4
    group_size: int

    @property
    def pack(self) -> int:
        return 32 // self.bits


GPTQ_BITS = (4, 8)
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}
AWQ_VERSIONS = ("gemm",)


def _field(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if name in config and config[name] is not None:
            return config[name]
    return default


def _group_size(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (value <= 0 and value != -1):
        raise QuantConfigError(f"{where}: group_size {value!r} is not supported (a positive number of input "
                               f"features per group, or -1 for one group per row)")
    return value


def parse_gptq_config(config: dict[str, Any], where: str = "quantization_config") -> GPTQConfig:
    method = config.get("quant_method", "gptq")
    if method != "gptq":
        raise QuantConfigError(f"{where}: quant_method {method!r} is not 'gptq'")
    bits = _field(config, "bits", "w_bit")
    if bits not in GPTQ_BITS:
        raise QuantConfigError(f"{where}: bits {bits!r} is not supported (GPTQ checkpoints load with bits "
                               f"{' or '.join(map(str, GPTQ_BITS))}; 2- and 3-bit packings are not implemented)")
    group_size = _group_size(_field(config, "group_size", default=128), where)
    fmt = _field(config, "checkpoint_format", default="gptq")
    if fmt not in GPTQ_FORMATS:
        raise QuantConfigError(f"{where}: checkpoint_format {fmt!r} is not supported (known: "
                               f"{', '.join(GPTQ_FORMATS)}; Marlin-repacked checkpoints are not read yet)")
    if _field(config, "is_marlin_format", default=False):
        raise QuantConfigError(f"{where}: is_marlin_format true is not supported (Marlin-repacked checkpoints "
                               f"are not read yet)")
    if config.get("dynamic"):
        raise QuantConfigError(f"{where}: dynamic (per-module overrides) is not supported")
    if config.get("lm_head"):
        raise QuantConfigError(f"{where}: lm_head true (a quantized LM head) is not supported; only linear layers "
                               f"inside the decoder blocks load quantized")
    return GPTQConfig(bits=bits, group_size=group_size, sym=bool(_field(config, "sym", default=True)),
                      desc_act=bool(_field(config, "desc_act", default=False)), zero_offset=GPTQ_FORMATS[fmt])


def parse_awq_config(config: dict[str, Any], where: str = "quantization_config") -> AWQConfig:
    method = config.get("quant_method", "awq")
    if method != "awq":
        raise QuantConfigError(f"{where}: quant_method {method!r} is not 'awq'")
    bits = _field(config, "bits", "w_bit")
    if bits != 4:
        raise QuantConfigError(f"{where}: bits {bits!r} is not supported (AWQ checkpoints load with bits 4)")
    group_size = _group_size(_field(config, "group_size", "q_group_size", default=128), where)
    version = str(_field(config, "version", default="gemm")).lower()
    if version not in AWQ_VERSIONS:
        raise QuantConfigError(f"{where}: version {version!r} is not supported (only AWQ's 'gemm' layout: "
                               f"qweight [in, out/8]; the 'gemv' and other layouts are not read)")
    if not _field(config, "zero_point", default=True):
        raise QuantConfigError(f"{where}: zero_point false is not supported (AWQ GEMM checkpoints carry qzeros)")
    return AWQConfig(bits=bits, group_size=group_size)


def modules_not_converted(config: dict[str, Any]) -> list[str]:
    """AWQ's ``modules_to_not_convert``: module name parts left in floating point."""
    return list(config.get("modules_to_not_convert") or [])
