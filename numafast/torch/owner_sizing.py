"""How large a loader's pools are: slots sized by their batches, how many fit under
``max_pinned_bytes``, and that bound. Arithmetic only: NodePools decides when to ask."""

from __future__ import annotations

from numafast import node_budget
from numafast._validate import integer
from numafast.errors import InvalidSizeError
from numafast.pool import pool_bytes, whole_pages

# Slots are this much larger than the batch that sized them (batches vary), rounded up to SLOT_GRAIN.
HEADROOM = 1.25
SLOT_GRAIN = 1 << 16
# How many times less the batches landed lately must need for smaller slots (grown_slot_bytes).
GROWN_SMALLER = 4


def slot_bytes_for(nbytes: int) -> int:
    """The slot size of a pool made for batches of ``nbytes``: HEADROOM more, in SLOT_GRAINs."""
    return -(-int(nbytes * HEADROOM) // SLOT_GRAIN) * SLOT_GRAIN


def grown_slot_bytes(first_slot_bytes: int, largest_batch: int) -> int:
    """The slots of a pool added for more: the first pool's size, or what the batches
    landed lately need (``largest_batch``) where that is far less, as when pools taken
    over from an earlier loader keep its larger slots: else a consumer keeping small
    batches would grow pools of that size until max_pinned_bytes refused more."""
    needed = slot_bytes_for(largest_batch)
    return needed if needed * GROWN_SMALLER <= first_slot_bytes else first_slot_bytes


def slots_within(slot_bytes: int, room: int) -> int:
    """How many slots of ``slot_bytes`` a pool mapping at most ``room`` bytes holds."""
    count = max(room, 0) // whole_pages(slot_bytes)
    while count and pool_bytes(slot_bytes, count) > room:
        count -= 1
    return count


def default_max_pinned_bytes(node: int) -> int:
    """The default bound on the loader pools' bytes: ``node``'s pinned budget, shared by
    every numafast process of this user on the node (:mod:`numafast.node_budget`): a
    quarter of its memory, or of this process's cgroup memory limit where lower. An
    explicit ``max_pinned_bytes`` bounds this process's loader pools, within that budget
    too. (Where RLIMIT_MEMLOCK is finite and the process lacks CAP_IPC_LOCK, the kernel
    refuses to lock past it too, and ``lock='auto'`` goes on unlocked, with a MemlockWarning.)"""
    return node_budget.budget_bytes(node, floor=SLOT_GRAIN)


def check_max_pinned_bytes(value: object) -> int | None:
    """``max_pinned_bytes`` checked: a positive int, or None for the default."""
    if value is None:
        return None
    number = integer(value)  # NumPy's integers too
    if number is None or number < 1:
        raise InvalidSizeError(f"max_pinned_bytes must be a positive number of bytes or None, not {value!r}")
    return number
