"""Rounds in rotation, for the benchmarks that set ways of running one thing side by side:
each round times every way once, the order rotating through every permutation (each way as
often first, middle and last), and each way's time is set against the first way's of the
same round."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence


def rotated(
    ways: Sequence[str], rounds: int, time_one: Callable[[str], float]
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each way's times over the rounds, and each way but the first its ratios to the
    first way's time in the same round."""
    orders = list(itertools.permutations(ways))
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    ratios: dict[str, list[float]] = {way: [] for way in ways[1:]}
    for n in range(rounds):
        times = {way: time_one(way) for way in orders[n % len(orders)]}
        for way in ways:
            seconds[way].append(times[way])
        for way in ways[1:]:
            ratios[way].append(times[way] / times[ways[0]])
    return seconds, ratios
