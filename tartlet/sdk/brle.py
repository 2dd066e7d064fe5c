"""Binary run-length encoding (BRLE) of boolean masks.

A BRLE mask is a list of non-negative run lengths that alternate between
``False`` and ``True`` bits, always starting with ``False`` (so a mask that
starts with ``True`` has a first run of 0). ``[0, 3, 2]`` is
``[True, True, True, False, False]``. Pie uses the same encoding for attention
and logit masks. This module is pure Python (no torch) so inferlets can use it
in a WASM build.
"""

from __future__ import annotations

from typing import Iterable, Sequence


def encode(bits: Iterable[bool]) -> list[int]:
    """Run lengths of ``bits``, starting with a (possibly empty) False run."""
    runs: list[int] = []
    current = False
    n = 0
    for b in bits:
        b = bool(b)
        if b == current:
            n += 1
        else:
            runs.append(n)
            current, n = b, 1
    runs.append(n)
    return runs


def decode(runs: Sequence[int]) -> list[bool]:
    """The bits of a BRLE mask.

    Raises:
        ValueError: a negative run length.
    """
    out: list[bool] = []
    for i, r in enumerate(runs):
        if r < 0:
            raise ValueError(f"BRLE run {i} is negative ({r})")
        out.extend([bool(i % 2)] * r)
    return out


def length(runs: Sequence[int]) -> int:
    """Number of bits the mask covers."""
    return sum(runs)


def from_ranges(size: int, ranges: Iterable[tuple[int, int]]) -> list[int]:
    """Mask of ``size`` bits that are True inside the half-open ``ranges``
    (which must be sorted and disjoint) and False elsewhere.

    Raises:
        ValueError: ranges out of order, overlapping or outside ``[0, size]``.
    """
    runs: list[int] = []
    pos = 0
    for start, end in ranges:
        if not pos <= start <= end <= size:
            raise ValueError(f"range [{start}, {end}) is out of order or outside [0, {size}]")
        runs += [start - pos, end - start]
        pos = end
    runs.append(size - pos)
    return runs


def excluding(size: int, ids: Iterable[int]) -> list[int]:
    """Mask of ``size`` bits that are True except at ``ids`` (any order,
    repeats allowed), e.g. a logit mask banning some token ids.

    Raises:
        ValueError: an id outside ``[0, size)``.
    """
    ranges, lo = [], 0
    for i in sorted(set(ids)):
        if not 0 <= i < size:
            raise ValueError(f"id {i} is outside [0, {size})")
        if i > lo:
            ranges.append((lo, i))
        lo = i + 1
    if lo < size:
        ranges.append((lo, size))
    return from_ranges(size, ranges)


def all_true(size: int) -> list[int]:
    """A mask of ``size`` True bits."""
    return [0, size]


def causal(position: int, size: int | None = None) -> list[int]:
    """Mask letting a token at logical ``position`` see positions
    ``[0, position]`` of a context of ``size`` (default ``position + 1``)."""
    size = position + 1 if size is None else size
    return [0, position + 1, size - position - 1]
