"""Human units, without a shell: sizes read and written in KiB/MiB/GiB, durations, plurals."""

from __future__ import annotations

import pytest

from torch_device_magic.errors import DeviceMagicError
from torch_device_magic.units import fmt_bytes, fmt_seconds, parse_bytes, plural


@pytest.mark.parametrize(("text", "expected"), [
    ("0", 0), ("1048576", 2**20), ("1MiB", 2**20), ("1.5 GB", 1_500_000_000), ("2kb", 2000),
])
def test_sizes_read_with_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "1 MiB of it", "-1", "1e400", "9" * 400])
def test_what_is_not_a_size_says_how_to_write_one(text):
    with pytest.raises(DeviceMagicError, match="is not a size: use bytes"):
        parse_bytes(text)


@pytest.mark.parametrize(("n", "signed", "expected"), [
    (None, False, "n/a"), (0, False, "0 B"), (0, True, "0 B"), (1023, False, "1023 B"),
    (1024, False, "1.0 KiB"), (1536, True, "+1.5 KiB"), (-3 * 2**20, True, "-3.0 MiB"),
    (-3 * 2**20, False, "-3.0 MiB"), (2**30, False, "1.0 GiB"), (2**50, False, "1024.0 TiB"),
])
def test_bytes_read_in_binary_units(n, signed, expected):
    assert fmt_bytes(n, signed=signed) == expected


@pytest.mark.parametrize(("s", "expected"), [
    (None, "n/a"), (0.0, "0 µs"), (0.000045, "45 µs"), (0.0123, "12.3 ms"), (1.25, "1.25 s"),
    (59.994, "59.99 s"), (125.0, "2 min 5 s"),
])
def test_durations_read_in_the_unit_that_fits(s, expected):
    assert fmt_seconds(s) == expected


@pytest.mark.parametrize(("n", "expected"), [
    (0, "0 cells"), (1, "1 cell"), (2, "2 cells"), (1204, "1,204 cells"),
])
def test_plurals(n, expected):
    assert plural(n, "cell") == expected
