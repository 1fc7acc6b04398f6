"""The GPUs' dense peaks by device name and precision, and the MFU a capture's counted work
claims against them (`claim`): the counted FLOP/s over the peak of the precision most of
the counted FLOPs ran in. Dense figures only: the datasheets headline 2:4-sparsity
figures, twice these. docs/profile.md gives each row's source.

    >>> claim(work, 4.1e14, Device("NVIDIA H100 80GB HBM3", 132, 80 * 2**30, (9, 0)))
    Claim(mfu=0.41..., peak=Peak(row='H100 SXM', dtype='bf16', ...), ...)
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..units import fmt_flops, plural
from .flops import Work

T = 1e12
PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
# kineto's dtype names (a counted op's first input's) to the precisions of the table
_PRECISION = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16",
              "c10::Float8_e4m3fn": "fp8", "c10::Float8_e5m2": "fp8",
              "c10::Float8_e4m3fnuz": "fp8", "c10::Float8_e5m2fnuz": "fp8"}
_NAMES = {"double": "fp64"}  # counted work of a precision the table has no row for
AMPERE = (8, 0)  # TF32 from here on
CPU_SHARE = 0.01  # counted FLOPs on the CPU past this share of them: no MFU on the GPU
SET_IT = "%config TorchDeviceMagics.peak_flops = FLOP/s (or a dict by dtype) sets it"


@dataclass(frozen=True, slots=True)
class Row:
    """One GPU's dense peaks in TFLOP/s by precision, and its full multiprocessors."""

    name: str
    tflops: Mapping[str, float]
    multiprocessors: int | None = None


def _row(name: str, fp32: float, tf32: float | None, bf16: float | None, fp16: float,
         fp8: float | None = None, sms: int | None = None) -> Row:
    figures = {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16, "fp8": fp8}
    return Row(name, {k: v for k, v in figures.items() if v is not None}, sms)


# fp32, tf32, bf16, fp16, fp8 (dense, TFLOP/s; fp16 and bf16 accumulating in fp32, as
# torch's matmuls do), and the full GPU's multiprocessors where a MIG slice may be cut
ROWS = {r.name: r for r in (
    _row("H200 SXM", 67, 494.7, 989.4, 989.4, 1978.9, 132),
    _row("H200 NVL", 60, 417.5, 835.5, 835.5, 1670.5, 132),
    _row("H100 SXM", 67, 494.7, 989.4, 989.4, 1978.9, 132),
    _row("H100 PCIe", 51, 378, 756, 756, 1513, 114),
    _row("H100 NVL", 60, 417.5, 835.5, 835.5, 1670.5, 132),
    _row("A100", 19.5, 156, 312, 312, None, 108),
    _row("L40S", 91.6, 183, 362.05, 362.05, 733),
    _row("L40", 90.5, 90.5, 181.05, 181.05, 362),
    _row("L4", 30.3, 60, 121, 121, 242.5),
    _row("A40", 37.4, 74.8, 149.7, 149.7),
    _row("A10", 31.2, 62.5, 125, 125),
    _row("T4", 8.1, None, None, 65),
    _row("V100 SXM2", 15.7, None, None, 125),
    _row("V100 PCIe", 14, None, None, 112),
    _row("V100S PCIe", 16.4, None, None, 130),
    _row("RTX 4090", 82.6, 82.6, 165.2, 165.2, 330.3),
    _row("RTX 3090", 35.6, 35.6, 71, 71),
)}
# rows whose figures are another's, not a datasheet's of their own
ASSUMED = {"A10G": ("A10", "AWS publishes no datasheet of the A10G's peaks: the A10's "
                    "figures assumed")}
_NVL_MEMORY = 85 * 2**30  # an H100 NVL's 94 GB, over an SXM's 80 GB


@dataclass(frozen=True, slots=True)
class Device:
    """What CUDA says of the device the cell used (`device()`)."""

    name: str
    multiprocessors: int | None = None
    total_memory: int | None = None
    capability: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Peak:
    """The peak an MFU was claimed against (`%%profile -o`'s `peak_flops`)."""

    row: str  # the table's row ('H100 SXM'), or 'yours' (TorchDeviceMagics.peak_flops)
    dtype: str  # 'bf16'
    flops: float  # FLOP/s: the slice's share, on a MIG slice
    source: str  # 'the table', 'TorchDeviceMagics.peak_flops'
    assumed: str | None = None  # why this row where the device's name did not say
    share: float = 1.0  # a MIG slice's share of the full GPU's multiprocessors


@dataclass(frozen=True, slots=True)
class Claim:
    """The MFU claimed (None, and `text` says why not, where none is) and what it said."""

    mfu: float | None
    peak: Peak | None
    text: str  # the overview's part; "" where nothing is said (no counted work)


def lookup(device: Device) -> tuple[Row | None, str | None, str | None]:
    """The table's row of a device, why it was assumed (where its name did not say), and
    why there is none where the name is known but its form cannot be told."""
    name = device.name.lower()
    sms = device.multiprocessors

    def has(pattern: str) -> bool:
        return re.search(pattern, name) is not None

    if has(r"\bh200\b"):
        if has(r"\bnvl\b"):
            return ROWS["H200 NVL"], None, None
        return ROWS["H200 SXM"], (None if has("sxm") else
                                  "its name does not say NVL: the SXM form assumed"), None
    if has(r"\bh100\b"):
        if has(r"\bnvl\b"):
            return ROWS["H100 NVL"], None, None
        if has(r"pcie|hbm2e"):
            return ROWS["H100 PCIe"], None, None
        if has(r"sxm|hbm3"):
            return ROWS["H100 SXM"], None, None
        if sms == 114:
            return ROWS["H100 PCIe"], "114 multiprocessors: the PCIe form", None
        if sms == 132 and device.total_memory:
            nvl = device.total_memory > _NVL_MEMORY
            return (ROWS["H100 NVL" if nvl else "H100 SXM"],
                    f"132 multiprocessors and {device.total_memory / 2**30:.0f} GiB: the "
                    f"{'NVL' if nvl else 'SXM'} form", None)
        return None, None, ("its name does not say SXM, PCIe or NVL, and its multiprocessors "
                            "do not tell")
    for key, (row, why) in ASSUMED.items():
        if has(rf"\b{key.lower()}\b"):
            return ROWS[row], why, None
    for pattern, row in _PATTERNS:
        if has(pattern):
            return ROWS[row], None, None
    return None, None, None


_PATTERNS = (
    (r"\ba100\b", "A100"), (r"\bl40s\b", "L40S"), (r"\bl40\b", "L40"), (r"\bl4\b", "L4"),
    (r"\ba40\b", "A40"), (r"\ba10\b", "A10"), (r"\bt4\b", "T4"),
    (r"\bv100s\b", "V100S PCIe"), (r"\bv100\b.*sxm", "V100 SXM2"), (r"\bv100\b.*pcie", "V100 PCIe"),
    (r"geforce rtx 4090$", "RTX 4090"), (r"geforce rtx 3090$", "RTX 3090"),
)


def precisions(work: Work, tf32_matmul: bool, tf32_conv: bool,
               capability: tuple[int, int] | None) -> Counter[str]:
    """The counted FLOPs by the precision they ran in: an fp32 matmul's as TF32 where
    torch lets matmuls use it (a convolution's where cuDNN's switch does) on a GPU that
    has TF32."""
    out: Counter[str] = Counter()
    tf32 = capability is not None and capability >= AMPERE
    for dtype, flops in work.by_dtype.items():
        precision = _PRECISION.get(dtype, _NAMES.get(dtype, dtype))
        if precision != "fp32":
            out[precision] += flops
            continue
        conv = work.conv_by_dtype.get(dtype, 0)
        out["tf32" if tf32 and tf32_matmul else "fp32"] += flops - conv
        out["tf32" if tf32 and tf32_conv else "fp32"] += conv
    return +out


def claim(work: Work, rate: float | None, device: Device | None, *, tf32_matmul: bool = False,
          tf32_conv: bool = True, yours: float | Mapping[str, float] | None = None,
          compiled_kernels: int = 0, compiled_calls: int = 0) -> Claim:
    """The MFU of counted work at `rate` (FLOP/s) on `device` (None: the CPU, never
    claimed), against the table's dense peak, or `yours` (TorchDeviceMagics.peak_flops:
    one figure, or one by precision), where set; the Triton kernels and compiled graphs'
    calls that ran (torch.compile's), whose work is not in the count."""
    if not work.flops or not rate:
        return Claim(None, None, "")
    if compiled_kernels or compiled_calls:
        ran = (plural(compiled_kernels, "Triton kernel") if compiled_kernels
               else plural(compiled_calls, "call") + " of its graphs")
        return Claim(None, None, f"torch.compile's code ran ({ran}), whose own work is not "
                     f"in the count{': no MFU' if device is not None else ''}")
    if device is None or not work.on_device:
        return Claim(None, None, "")  # the CPU: no reliable peak to hold it against
    if work.flops - work.on_device > CPU_SHARE * work.flops:
        return Claim(None, None, f"no MFU: {percent(1 - work.on_device / work.flops)} of the "
                     "counted FLOPs ran on the CPU")
    by = precisions(work, tf32_matmul, tf32_conv, device.capability)
    if not by:
        return Claim(None, None, "")
    dtype, top = by.most_common(1)[0]
    mixed = ("" if len(by) == 1 else
             f"; {top / sum(by.values()):.0%} of the counted FLOPs were {dtype}, the rest "
             f"{', '.join(k for k in by if k != dtype)}")
    if yours is not None:
        figure = yours if isinstance(yours, (int, float)) else yours.get(dtype)
        if figure is None:
            return Claim(None, None, f"no MFU: TorchDeviceMagics.peak_flops gives no {dtype} "
                         f"peak{mixed}")
        peak = Peak("yours", dtype, float(figure), "TorchDeviceMagics.peak_flops")
        return _said(rate, peak, f"your {dtype} peak", mixed)
    row, assumed, why = lookup(device)
    if row is None:
        said = (f"the peak of {device.name} is unknown" if why is None
                else f"no MFU on {device.name}: {why}")
        return Claim(None, None, f"{said}; {SET_IT}")
    if dtype not in row.tflops:
        return Claim(None, None, f"no MFU: the {row.name} has no {dtype} peak in the table"
                     f"{mixed}; {SET_IT}")
    share, slice_ = 1.0, ""
    mig = re.search(r"\bMIG\s+(\S+)", device.name)
    if mig is not None:
        if not device.multiprocessors or not row.multiprocessors:
            return Claim(None, None, f"no MFU on a MIG slice ({mig.group(1)}) whose "
                         "multiprocessors could not be read")
        share = device.multiprocessors / row.multiprocessors
        slice_ = (f" MIG {mig.group(1)} slice's share ({device.multiprocessors} of its "
                  f"{row.multiprocessors} multiprocessors) of the")
    peak = Peak(row.name, dtype, row.tflops[dtype] * T * share, "the table", assumed, share)
    whose = f"the{slice_} {row.name}'s {dtype} dense peak"
    return _said(rate, peak, whose, mixed + (f"; {assumed}" if assumed else ""))


def _said(rate: float, peak: Peak, whose: str, after: str) -> Claim:
    mfu = rate / peak.flops
    over = "; over 100%: that peak is too low for this device" if mfu > 1 else ""
    return Claim(mfu, peak, f"MFU {percent(mfu)} of {whose} ({fmt_flops(peak.flops, True)})"
                 f"{after}{over}")


def percent(share: float) -> str:
    """'38%'; a small share '0.41%', 'under 0.01%'."""
    if share >= 0.01:
        return f"{share:.0%}"
    return f"{share:.2%}" if share >= 0.0001 else "under 0.01%"


def device() -> Device | None:
    """The current CUDA device's name, multiprocessors, memory and capability, where CUDA
    is up (nothing here starts it); None otherwise."""
    import torch

    if not torch.cuda.is_initialized():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return Device(str(props.name), getattr(props, "multi_processor_count", None),
                  getattr(props, "total_memory", None), (props.major, props.minor))


def tf32_matmul() -> bool:
    """Whether torch lets fp32 matmuls use TF32 now."""
    import torch

    return (torch.get_float32_matmul_precision() != "highest"
            or bool(torch.backends.cuda.matmul.allow_tf32))


def check_yours(value: Any) -> float | dict[str, float] | None:
    """`TorchDeviceMagics.peak_flops` as given, checked: None, a figure in FLOP/s, or a dict
    of them by precision; ValueError (one sentence) for anything else."""
    def figure(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v <= 0:
            raise ValueError
        return float(v)

    try:
        if value is None:
            return None
        if isinstance(value, Mapping):
            if not value or any(k not in PRECISIONS for k in value):
                raise ValueError
            return {k: figure(v) for k, v in value.items()}
        return figure(value)
    except ValueError:
        raise ValueError(
            f"peak_flops must be a peak in FLOP/s above 0 (989e12), a dict of them by "
            f"precision ({{'bf16': 989e12}}) with keys among {', '.join(PRECISIONS)}, or "
            f"None (the table's), not {value!r}") from None
