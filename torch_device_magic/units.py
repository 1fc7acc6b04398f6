"""Human units for what users read: bytes in KiB/MiB/GiB, durations in µs/ms/s."""

from __future__ import annotations

import math
import re

from .errors import DeviceMagicError

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
_BYTE_SCALES = tuple(1024**unit for unit in range(len(_BYTE_UNITS)))


def fmt_bytes(n: float | None, signed: bool = False) -> str:
    """`fmt_bytes(1536) == '1.5 KiB'`; None reads 'n/a'; `signed` adds '+' to growth."""
    if n is None:
        return "n/a"
    if not n:
        return "0 B"
    sign = "-" if n < 0 else ("+" if signed else "")
    value = abs(n)
    # Every report line formats two or more sizes, most often 0: the unit comes from the
    # bit length of the whole bytes (1024 is 2**10), with no loop of divisions.
    unit = (int(value).bit_length() - 1) // 10
    if unit <= 0:
        return f"{sign}{int(value)} B"
    if unit >= len(_BYTE_UNITS):
        unit = len(_BYTE_UNITS) - 1
    return f"{sign}{value / _BYTE_SCALES[unit]:.1f} {_BYTE_UNITS[unit]}"


def fmt_per_device(nbytes: dict[str, int]) -> str:
    """`fmt_per_device({'cpu': 2048, 'cuda:0': 2**30}) == '2.0 KiB on cpu, 1.0 GiB on cuda:0'`."""
    return ", ".join(f"{fmt_bytes(n)} on {dev}" for dev, n in nbytes.items())


def plural(n: int, word: str) -> str:
    """`plural(1, 'cell') == '1 cell'`, `plural(1204, 'object') == '1,204 objects'`."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def fmt_seconds(s: float | None) -> str:
    """`fmt_seconds(0.0123) == '12.3 ms'`; None reads 'n/a'."""
    if s is None:
        return "n/a"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 60:
        return f"{s:.2f} s"
    minutes, rest = divmod(s, 60)
    return f"{int(minutes)} min {rest:.0f} s"



_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)


def fmt_flops(n: float, per_second: bool = False) -> str:
    """`fmt_flops(6.7e8) == '670 MFLOP'`, `fmt_flops(4.12e10, True) == '41.2 GFLOP/s'`: three
    significant figures, in the unit where the figure is under 1,000."""
    unit = "FLOP/s" if per_second else "FLOP"
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.3g} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def parse_bytes(text: str) -> int:
    """`parse_bytes('1.5MiB') == 1572864`: bytes, KiB/MiB/GiB/TiB, or kB/MB/GB/TB (powers of 10)."""
    match = _SIZE.fullmatch(text)
    value = math.inf
    if match is not None:
        number, unit = match.groups()
        scale = 1
        if unit:
            power = "kmgt".index(unit[0].lower()) + 1
            scale = (1024 if unit.lower().endswith("i") else 1000) ** power
        value = float(number) * scale
    if not math.isfinite(value):  # no match, or too large for a float (1e400)
        raise DeviceMagicError(f"{text!r} is not a size: use bytes (1048576) or 1MiB, 1.5GB")
    return int(value)
