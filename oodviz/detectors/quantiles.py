"""Exact quantiles of a stream, per column, in few passes and bounded memory; mergeable across shards.

React's clipping percentile (one "column": all the activations) and vra's per-unit percentiles (``D``
columns) are order statistics of the fit features that pytorch-ood finds with ``np.quantile`` on every value
held in RAM. :class:`ColumnQuantiles` finds the same numbers **exactly** without holding the values, by a
radix selection on float32 keys that sort like the values (:func:`sortable_keys`), over passes that read the
same rows again:

1. **count** the top ``b`` bits of every key, per column (``b`` from 9 to 16 bits, so that ``D x 2^b`` stays
   near a million counts); the merged counts locate, per column, the bin of each order statistic that the
   quantiles interpolate between (at most two per quantile) and its rank within the bin;
2. **collect** the keys in those bins when there are at most :data:`COLLECT_LIMIT` of them (their number
   is known from the counts): sorted, they give each order statistic's exact key, and the fit is done. When
   there are more (a very long stream, or values that crowd one bin), the pass instead **counts** the next 8
   bits of the keys in those bins, and the choice comes again after it (after 32 bits the keys are known).

Each pass also keeps the smallest and largest key of every bin: an order statistic in a bin that holds one
key (the zeros of ReLU features, often where a low percentile falls) is known at once, and needs no more pass.
So two passes in the usual case (one when every order statistic is in such a bin), whatever the number of
rows, and ``O(D x 2^b + COLLECT_LIMIT)`` memory. The quantiles are then interpolated as ``np.quantile``'s
default ("linear") method does, in float64: they equal ``np.quantile`` of the float32 values taken as float64,
bit for bit. Values of other dtypes are rounded to float32 first.

Split over shards (the state protocol, :mod:`oodviz.detectors.protocol`) every pass's state merges exactly:
counts add, the bins' smallest and largest keys take the minimum and maximum, collected keys concatenate (they
are sorted before use), so the next pass, planned from the merged state, is the same on every shard and the
quantiles are those of all the shards' rows.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: at most this many keys are collected (int64: 32 MiB) in the pass that ends the selection
COLLECT_LIMIT = 1 << 22
#: counts of the first pass: ``columns x 2^bits`` near this many
FIRST_COUNTS = 1 << 20
_REFINE_BITS = 8
_KEY_BITS = 32
_SIGN = 1 << 31
_SIGN_INT32 = -(1 << 31)  # the sign bit as an int32 value
_BLOCK_VALUES = 1 << 20  # keys formed at once (int64: 8 MiB)


def sortable_keys(values: Tensor) -> Tensor:
    """Keys ``[0, 2^32)`` of the float32 values, ordered like the values (``-0.0`` just below ``+0.0``), in the
    shape of ``values``, as int64.

    Non-negative floats: the bit pattern grows with the value; setting the sign bit puts them above
    the negatives. Negative floats: the pattern grows with the magnitude; flipping every bit
    reverses that and clears the sign bit. One XOR with ``(bits >> 31) | sign`` does both.
    """
    bits = values.detach().to(torch.float32).contiguous().view(torch.int32)
    return (bits ^ ((bits >> 31) | _SIGN_INT32)).long() & 0xFFFFFFFF


def keys_to_floats(keys: Tensor) -> Tensor:
    """The float32 values whose :func:`sortable_keys` keys (int64 in ``[0, 2^32)``) these are."""
    bits = torch.where(keys >= _SIGN, keys - _SIGN, -1 - keys)  # the int32 bit pattern, as a signed number
    return bits.to(torch.int32).view(torch.float32)


def lerp(a, b, t: float):
    """``a + t (b - a)`` computed as numpy's ``_lerp`` does for ``method="linear"`` (monotone at both ends);
    ``a``, ``b`` numbers or tensors."""
    diff = b - a
    return b - diff * (1 - t) if t >= 0.5 else a + diff * t


def first_bits(columns: int) -> int:
    """Bits counted by the first pass: ``columns x 2^bits`` near :data:`FIRST_COUNTS`, 9 to 16 bits."""
    return min(16, max(9, int(math.log2(FIRST_COUNTS / max(columns, 1)))))


class ColumnQuantiles:
    """Exact ``np.quantile(x, quantiles, axis=0)`` (linear method) of a stream of ``[B, D]`` rows (module
    docstring). Usage, with the same rows in every pass (any batching and order)::

        cq = ColumnQuantiles([0.01, 0.99])
        while not cq.complete:
            for x in stream: cq.update(x)
            cq = cq.next_pass()                # merge the shards' states first
        cq.result()                            # [2, D] float64

    A pass's state: its ``plan`` (made by the previous pass; None in the first), the rows it saw, and either its
    counts, smallest and largest keys per bin (``[G, D, 2^b]`` int64 each, ``G`` = 1 in the first pass, else the
    number ``R`` of distinct order statistics wanted, at most two per quantile) or its collected keys
    (``(r D + d) 2^32 + key``, int64). A bin whose smallest and largest keys are equal holds one value (the
    zeros of ReLU features, say): an order statistic in it is known without another pass.
    """

    def __init__(self, quantiles: list[float], plan: dict | None = None):
        self.quantiles = [float(q) for q in quantiles]
        self.plan = plan
        self.rows = 0
        self.counts: Tensor | None = None
        self.low: Tensor | None = None
        self.high: Tensor | None = None
        self.found: list[Tensor] = []

    @property
    def complete(self) -> bool:
        """The order statistics are known: :meth:`result`, no more passes."""
        return self.plan is not None and self.plan["kind"] == "done"

    # -- one pass --------------------------------------------------------------------------------
    def update(self, x: Tensor) -> None:
        """Add the rows ``x`` ``[B, D]`` to this pass."""
        if self.complete:
            raise RuntimeError("ColumnQuantiles.update after the last pass: read result()")
        width = x.shape[1]
        step = max(1, _BLOCK_VALUES // max(width, 1))
        for start in range(0, len(x), step):
            keys = sortable_keys(x[start : start + step])
            if self.plan is None:
                self._count(keys, torch.zeros(1, width, dtype=torch.long, device=keys.device), 0, first_bits(width))
            elif self.plan["kind"] == "count":
                self._count(keys, self.plan["prefix"], self.plan["known"], self.plan["bits"])
            else:
                upper = keys >> (_KEY_BITS - self.plan["known"])
                for prefix, tags in zip(self.plan["prefix"], self.plan["tags"], strict=True):
                    self.found.append((keys + tags)[upper == prefix])
        self.rows += len(x)

    def _count(self, keys: Tensor, prefix: Tensor, known: int, bits: int) -> None:
        """Per order statistic ``r``: count, and keep the smallest and largest key of, each value of the ``bits``
        bits after the first ``known`` of the keys whose first ``known`` bits are ``prefix[r]`` (per column)."""
        width, bins = keys.shape[1], 1 << bits
        if self.counts is None:
            shape, device = (len(prefix), width, bins), keys.device
            self.counts = torch.zeros(shape, dtype=torch.long, device=device)
            self.low = torch.full(shape, 1 << _KEY_BITS, dtype=torch.long, device=device)  # above every key
            self.high = torch.full(shape, -1, dtype=torch.long, device=device)
        cells = torch.arange(width, device=keys.device) * bins + ((keys >> (_KEY_BITS - known - bits)) & (bins - 1))
        for r in range(len(prefix)):
            chosen = None if known == 0 else (keys >> (_KEY_BITS - known)) == prefix[r]
            where, which = (cells, keys) if chosen is None else (cells[chosen], keys[chosen])
            where, which = where.flatten(), which.flatten()
            self.counts[r] += torch.bincount(where, minlength=width * bins).view(width, bins)
            self.low[r].view(-1).scatter_reduce_(0, where, which, "amin")
            self.high[r].view(-1).scatter_reduce_(0, where, which, "amax")

    def merge(self, other: ColumnQuantiles) -> ColumnQuantiles:
        """Add the state of ``other``, which saw other rows in the same pass (counts add, smallest and largest keys
        take the minimum and maximum, collected keys concatenate)."""
        if self._known() != other._known():
            raise ValueError("ColumnQuantiles.merge: the states are at different passes")
        if other.counts is not None:
            if self.counts is None:
                self.counts, self.low, self.high = (t.clone() for t in (other.counts, other.low, other.high))
            else:
                device = self.counts.device
                self.counts.add_(other.counts.to(device))
                torch.minimum(self.low, other.low.to(device), out=self.low)
                torch.maximum(self.high, other.high.to(device), out=self.high)
        self.found += other.found
        self.rows += other.rows
        return self

    def _known(self) -> int:
        return -1 if self.plan is None else self.plan["known"]

    def state_dict(self) -> dict:
        return {
            "plan": self.plan,
            "rows": self.rows,
            "counts": self.counts,
            "low": self.low,
            "high": self.high,
            "found": list(self.found),
        }

    def load_state_dict(self, state: dict) -> ColumnQuantiles:
        self.plan, self.rows = state["plan"], state["rows"]
        self.counts, self.low, self.high = state["counts"], state["low"], state["high"]
        self.found = list(state["found"])
        return self

    # -- between passes --------------------------------------------------------------------------
    @staticmethod
    def _virtual_index(quantile: float, rows: int) -> tuple[int, int, float]:
        h = (rows - 1) * quantile
        below = math.floor(h)
        return below, min(below + 1, rows - 1), h - below

    def next_pass(self) -> ColumnQuantiles:
        """The state after this pass (all of it: merge the shards' states first): the empty state of the next
        pass, or a :attr:`complete` one."""
        if self.plan is None:
            if not self.rows:
                raise ValueError("ColumnQuantiles: no rows were counted")
            ranks = sorted({rank for q in self.quantiles for rank in self._virtual_index(q, self.rows)[:2]})
            within = torch.tensor(ranks, device=self.counts.device)[:, None].repeat(1, self.counts.shape[1])
            plan = {"rows": self.rows, "ranks": ranks, "kind": "count", "known": 0, "bits": first_bits(within.shape[1])}
            plan.update(within=within, prefix=torch.zeros_like(within), keys=torch.zeros_like(within))
            plan["resolved"] = torch.zeros_like(within, dtype=torch.bool)
            tables = (self.counts, self.counts.cumsum(dim=2), self.low, self.high)  # one table for every rank
            counts, cumulative, low, high = (t.expand(len(ranks), -1, -1) for t in tables)
        else:
            plan, counts, low, high = self.plan, self.counts, self.low, self.high
            cumulative = None if plan["kind"] == "collect" else counts.cumsum(dim=2)  # [R, D, bins]
        if self.rows != plan["rows"]:
            raise ValueError(
                f"ColumnQuantiles: a pass saw {self.rows} rows, the first saw {plan['rows']}; "
                "every pass must read the same rows"
            )
        following = {"rows": plan["rows"], "ranks": plan["ranks"], "within": plan["within"]}
        if plan["kind"] == "collect":
            return ColumnQuantiles(self.quantiles, {**following, "kind": "done", "keys": self._collected_keys()})
        bits = plan["bits"]
        if cumulative.stride(0) == 0:  # the first pass: one table for every order statistic, searched as [D, R]
            digit = torch.searchsorted(cumulative[0], plan["within"].T.contiguous(), right=True).T[..., None]
        else:
            digit = torch.searchsorted(cumulative, plan["within"][..., None], right=True)  # [R, D, 1]
        digit = digit.clamp(max=(1 << bits) - 1)
        before = torch.where(digit > 0, cumulative.gather(2, (digit - 1).clamp(min=0)), 0).squeeze(2)
        known = plan["known"] + bits
        single = low.gather(2, digit).squeeze(2) == high.gather(2, digit).squeeze(2)  # one key in the bin
        resolved = plan["resolved"] | single
        keys = torch.where(single & ~plan["resolved"], low.gather(2, digit).squeeze(2), plan["keys"])
        in_bin = torch.where(resolved, 0, counts.gather(2, digit).squeeze(2))  # keys left to look at, per group
        prefix = torch.where(resolved, -1, (plan["prefix"] << bits) | digit.squeeze(2))  # -1: no key matches
        following.update(known=known, within=plan["within"] - before, prefix=prefix, keys=keys, resolved=resolved)
        following["in_bin"] = in_bin
        # order statistics in the bin of the one before (below and above an interpolation, often): collected once
        source = torch.arange(len(prefix), device=prefix.device)[:, None].repeat(1, prefix.shape[1])
        for r in range(1, len(prefix)):
            shared = (prefix[r] == prefix[r - 1]) & ~resolved[r]
            source[r] = torch.where(shared, source[r - 1], r)
        sizes = torch.where(source == torch.arange(len(prefix), device=prefix.device)[:, None], in_bin, 0)
        if bool(resolved.all()):
            following["kind"] = "done"
        elif int(sizes.sum()) <= COLLECT_LIMIT:
            columns = torch.arange(prefix.numel(), device=prefix.device).view_as(prefix)
            collected = torch.where(sizes > 0, prefix, -1)
            following.update(kind="collect", tags=columns << _KEY_BITS, prefix=collected, in_bin=sizes, source=source)
        else:
            following.update(kind="count", bits=min(_REFINE_BITS, _KEY_BITS - known))
        return ColumnQuantiles(self.quantiles, following)

    def _collected_keys(self) -> Tensor:
        """``[R, D]``: the keys of the order statistics, after a collecting pass (its keys sorted by order
        statistic, column and key; an unresolved one is the ``within``-th key of the group that collected its bin,
        ``source``: itself, or the order statistic before it when they share the bin)."""
        plan = self.plan
        found = torch.cat(self.found).sort().values
        sizes = plan["in_bin"]
        if len(found) != int(sizes.sum()):
            raise ValueError("ColumnQuantiles: the last pass did not read the rows of the first")
        first = (sizes.flatten().cumsum(0) - sizes.flatten()).view_as(sizes)  # where each (r, d) group starts
        start = first.gather(0, plan["source"])  # the group that collected the bin's keys
        pending = ~plan["resolved"]
        keys = plan["keys"].clone()
        keys[pending] = found[(start + plan["within"])[pending]] & 0xFFFFFFFF
        return keys

    def result(self) -> Tensor:
        """``[len(quantiles), D]`` float64: the quantiles of every column, numpy's linear interpolation."""
        if not self.complete:
            raise RuntimeError("ColumnQuantiles: the selection needs more passes (update, then next_pass)")
        values = keys_to_floats(self.plan["keys"]).double()
        ranks, rows = self.plan["ranks"], []
        for q in self.quantiles:
            below, above, fraction = self._virtual_index(q, self.plan["rows"])
            a, b = values[ranks.index(below)], values[ranks.index(above)]
            rows.append(lerp(a, b, fraction))  # elementwise on tensors, the branch on the scalar fraction
        return torch.stack(rows)
