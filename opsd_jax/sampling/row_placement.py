"""Which prefilled row goes into which of the engine's free slots, so that each row is
prefilled on the devices that hold its slot.

The engine's pool of B slots is laid out over the devices' batch axes as any array of rows is
(models/sharding.py): in S equal shares, slot s on the devices of share s // (B / S); a
prefill of R rows the same way, row r in share r // (R / S). A row prefilled on other devices
than its slot's would cross devices in the insert, and XLA's partitioned scatter there gathers
every row to every device first (a temp of 7.49 GiB in the paper recipe's insert on 8 H100s).
Dealt as below, each device writes its own rows into its own slots
(pool_programs.insert_rows with `local_slots`). The price: where the free slots lie mostly in
one share, the other shares prefill padding rows (at most one share's rows each, which the
preflight counts: it compiles the prefill of a whole pool).
"""

from __future__ import annotations

from collections.abc import Sequence

from models.sharding import per_device


def placed_rows(
    free: Sequence[int], count: int, shares: int, pool_size: int
) -> list[tuple[int | None, int]]:
    """Where a prefill's rows go: for each row, (the place of its prompt among the `count`
    taken, its slot), or (None, pool_size) for a padding row (dropped); count <= len(free).

    With the pool's rows in `shares` shares, the prompts are dealt in turn to the shares that
    have free slots, and each share's rows are padded to one count, a power of two, so row r
    lands in the share of its slot. With one share: the first free slots in order, padded to a
    power of two or the whole pool."""
    if shares == 1:
        size = min(1 << (count - 1).bit_length(), pool_size)
        return [(i, free[i]) for i in range(count)] + [(None, pool_size)] * (size - count)
    share = pool_size // shares
    open_slots = [[s for s in free if s // share == k] for k in range(shares)]
    dealt: list[list[int]] = [[] for _ in range(shares)]
    k = 0
    for place in range(count):
        while len(dealt[k]) == len(open_slots[k]):
            k = (k + 1) % shares
        dealt[k].append(place)
        k = (k + 1) % shares
    per_share = min(1 << (max(map(len, dealt)) - 1).bit_length(), share)
    rows = []
    for k in range(shares):
        rows += [(place, open_slots[k][j]) for j, place in enumerate(dealt[k])]
        rows += [(None, pool_size)] * (per_share - len(dealt[k]))
    return rows


def own_slots(placed: list[tuple[int | None, int]], shares: int, pool_size: int) -> list[int]:
    """Each row's slot among its share's own (insert_rows' `local_slots`): slot s is
    s % (pool_size / shares) there; a padding row's is past the share (dropped)."""
    share = pool_size // shares
    return [slot % share if slot < pool_size else share for _, slot in placed]


def row_shares(rows: int) -> int:
    """Into how many devices' shares `rows` rows are split under the active mesh and rules (1:
    each device holds every row)."""
    return rows // per_device((rows,), ("act_batch",))[0]


def first_group_rows(pool_size: int, prefill_rows: int) -> int:
    """The rows of the first prefill into an empty pool of `pool_size` slots, under the active
    mesh and rules, when the engine prefills at most `prefill_rows` prompts at once (0: all,
    as the config's rollout_prefill_rows): padded as `placed_rows` pads them (what the
    preflight and bench/scale.py compile)."""
    count = min(prefill_rows or pool_size, pool_size)
    return len(placed_rows(range(pool_size), count, row_shares(pool_size), pool_size))
