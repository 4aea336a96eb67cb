"""Argument types the ``numafast`` subcommands share: node and CPU lists in numactl's
syntax, counts and thresholds in their meaningful range.

Each turns a bad value into an argparse error that names the option's value and what
is allowed, before anything is bound, allocated or measured.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from numafast._validate import allowed_nodes, parse_list


class UsageError(ValueError):
    """Options that contradict each other: reported as argparse reports a bad one (its
    usage line, then the message; exit status 2)."""


def node_list(text: str) -> list[int]:
    """A node list as numactl reads it (all, 0-2,5, !1, +0-1), within the cpuset's nodes."""
    try:
        return parse_list(text, allowed_nodes(), "node")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def cpu_list(text: str) -> list[int]:
    """A CPU list as numactl reads it (all, 0-3, !0, +0-1), within the CPUs this process may use."""
    from numafast.binding import cpus_allowed

    try:
        return parse_list(text, sorted(cpus_allowed()), "cpu")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def count(least: int, most: int | None = None) -> Callable[[str], int]:
    """An integer argument of at least ``least`` (``--max-cores 0`` would leave no CPU)
    and at most ``most``."""
    allowed = f">= {least}" if most is None else f"from {least} to {most}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least or (most is not None and value > most):
            raise argparse.ArgumentTypeError(f"{text!r}: give an integer {allowed}")
        return value

    parse.__name__ = f"integer {allowed}"
    return parse


def threshold(least: float, *, inclusive: bool = True) -> Callable[[str], float]:
    """A finite number >= ``least`` (> with ``inclusive=False``): a health-check threshold
    outside that range could never fail, or always would."""
    relation = ">=" if inclusive else ">"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < least or (not inclusive and value == least):
            raise argparse.ArgumentTypeError(f"{text!r}: give a finite number {relation} {least:g}")
        return value

    parse.__name__ = f"number {relation} {least:g}"
    return parse
