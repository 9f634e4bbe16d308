"""Launch-size arithmetic for the kernel wrappers, in plain Python.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions in Triton 3.6: called from the host
each goes through their wrapper (~2.5-4 µs), and an eager step makes three to five such calls for each of
hundreds of launches. These give the same results (next_power_of_2(0) == 0, as Triton's)."""

from __future__ import annotations


def cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1); 0 for 0."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
