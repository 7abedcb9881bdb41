"""One expert budget split between several models by value (the daemon and the simulator).

Every served model has a *share* of the budget: the bytes of its arena it may use (its cache's
``set_budget``; slots per size class from ``moecached.engine.arena.plan_slots``). Shares move in steps
of ``step`` bytes toward the model where one more step saves the most reads:

* **Ghosts.** Each model's cache remembers, per size class, the keys it evicted last (a FIFO of
  keys, no bytes): as many as one more step would add to that class
  (:meth:`Split.ghost_slots`). A demanded miss on a remembered key is a *ghost hit*: a hit the
  model would have had with one more step (for LRU exactly: its stack distance lies just past
  the share). Ghost hits count reads per step of memory, so a model with big experts (fewer
  slots per GiB) and a model with a low request rate (fewer accesses per period) are weighed
  by what one more GiB really saves. ``weight`` multiplies a model's counts.
* **Value learned per share.** The gain of growing model m is its ghost hits of the last
  period; the loss of shrinking it is the ghost hits it had when its share was one step
  smaller (remembered per share, ``table``), or its current gain when it never was there (a
  hit-rate curve is concave, so that is a lower bound). Remembering the loss is what stops a
  model from being shrunk again right after its lost step showed up as ghost hits.
* **One move per period, with hysteresis.** The model with the highest gain receives one step
  from the model with the lowest loss when ``gain > loss * (1 + hysteresis)`` and the gain
  exceeds the loss by at least ``min_gain`` ghost hits; every share stays within its model's
  ``[min_bytes, max_bytes]``. Ties go to the model named first.
* **The total moves** (the memory floor): :meth:`Split.set_total` scales every share by the
  same factor within its bounds, so the learned proportions survive: the factor applies to
  the shares the last move left, so a total shrunk and grown back gives every share back.

Everything here is pure and deterministic: the same counts in the same order give the same
shares. The daemon calls :meth:`Split.rebalance` every ``split_interval_s`` with the ghost hits
its caches counted; ``moecache-ctl policy --mix`` replays interleaved traces and calls it every
``split_every`` tokens with the ghost hits of its own replay (``moecached.tools.simulate``).
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass, field

from moecached.engine.arena import arena_bytes, plan_slots, smallest_budget

__all__ = ["Member", "Split", "SplitError", "least_share", "DEFAULT_HYSTERESIS",
           "DEFAULT_STEPS", "MIN_GAIN"]

#: a receiver's gain must exceed the donor's loss by this factor (plus MIN_GAIN)
DEFAULT_HYSTERESIS = 0.25
#: default step: the total budget over this many steps (at least one slot per class of every model)
DEFAULT_STEPS = 32
#: ghost hits a move must gain over what it loses, at least
MIN_GAIN = 2


class SplitError(ValueError):
    """Bounds that cannot be met (sum of minimums above the total, min above max, ...)."""


def least_share(index, top_k: int, page_size: int = mmap.PAGESIZE) -> int:
    """Smallest share a model is served with: two layers' top-k of every size class (one layer
    computing, the next loading), in arena bytes; never below the smallest arena it runs with."""
    per_class = {sc.id: min(2 * int(top_k), len(sc.layers) * int(index.n_experts))
                 for sc in index.size_classes}
    return max(arena_bytes(index, per_class, page_size), smallest_budget(index, page_size))


@dataclass
class Member:
    """One model in the split. ``index``: its expert index (or any object with ``size_classes``
    and ``n_experts``, as ``plan_slots`` takes); ``min_bytes``/``max_bytes``: bounds of its
    share (``max_bytes`` None: the arena of all its experts); ``weight``: multiplies its ghost
    hits."""
    name: str
    index: object
    min_bytes: int
    max_bytes: int | None = None
    weight: float = 1.0
    page_size: int = mmap.PAGESIZE
    full_bytes: int = field(init=False, default=0)

    def __post_init__(self):
        ne = int(self.index.n_experts)
        self.full_bytes = arena_bytes(self.index, {sc.id: len(sc.layers) * ne
                                                   for sc in self.index.size_classes},
                                      self.page_size)
        if self.max_bytes is None or self.max_bytes > self.full_bytes:
            self.max_bytes = self.full_bytes
        if self.min_bytes > self.max_bytes:
            raise SplitError(f"model {self.name}: min_budget {self.min_bytes} bytes is above its "
                             f"max_budget {self.max_bytes} bytes; lower min_budget")
        if not self.weight > 0:
            raise SplitError(f"model {self.name}: weight = {self.weight}: expected a number > 0")

    def slots(self, share: int) -> dict:
        """Slots per size class id for ``share`` bytes (the cache's ``set_budget``)."""
        return plan_slots(self.index, budget_bytes=int(min(share, self.full_bytes)),
                          page_size=self.page_size)


class Split:
    """Shares of ``total`` bytes between ``members`` (module docstring).

    Args:
        total: bytes to split (the budget, or what the memory floor leaves of it).
        members: list of :class:`Member`, in order (ties go to the earlier one).
        step: bytes a share moves by (None: ``total / DEFAULT_STEPS``, at least what one more
            slot in every size class costs the largest model); 0 freezes the shares (a static
            split).
        hysteresis: see the module docstring.
        shares: starting shares by name (None: an equal split by weight within the bounds).
    Raises:
        SplitError: the minimums do not fit in ``total``.
    """

    def __init__(self, total: int, members, *, step: int | None = None,
                 hysteresis: float = DEFAULT_HYSTERESIS, shares: dict | None = None):
        self.members = {m.name: m for m in members}
        self.total = int(total)
        self.hysteresis = float(hysteresis)
        self._step = step
        self.step = self._pick_step()
        self.table = {m: {} for m in self.members}   # name -> {share: ghost hits seen there}
        self.moves = 0
        self.shares = self._fill(self.total, shares)
        self._base = dict(self.shares)   # the proportions set_total scales (module docstring)

    # ---------------------------------------------------------------- bounds and totals
    def _pick_step(self) -> int:
        if self._step is not None:
            return int(self._step)
        unit = 0
        for m in self.members.values():   # one more slot of every class
            one = {sc.id: 1 for sc in m.index.size_classes}
            unit = max(unit, arena_bytes(m.index, one, m.page_size))
        return max(self.total // DEFAULT_STEPS, unit)

    def _check(self, total: int) -> None:
        need = sum(m.min_bytes for m in self.members.values())
        if need > total:
            names = ", ".join(f"{m.name} {m.min_bytes}" for m in self.members.values())
            raise SplitError(f"the models' minimum shares ({names} bytes) add up to {need} bytes, "
                             f"above the {total} bytes to split: raise the budget or lower "
                             "min_budget")

    def _fill(self, total: int, want: dict | None) -> dict:
        """Shares summing to ``total`` (less only when every share is at its max): ``want`` (or
        weights) scaled into the bounds."""
        self._check(total)
        ms = list(self.members.values())
        if want is None:
            want = {m.name: m.weight for m in ms}
        out: dict = {}
        free = list(ms)
        left = total
        while free:   # water-fill: clamp whoever hits a bound, spread the rest again
            tw = sum(max(0, want.get(m.name, 0)) for m in free) or len(free)
            clamped = False
            for m in free:
                w = max(0, want.get(m.name, 0)) if tw else 1
                x = int(left * w // tw)
                if x < m.min_bytes or x > m.max_bytes:
                    out[m.name] = min(max(x, m.min_bytes), m.max_bytes)
                    left -= out[m.name]
                    free.remove(m)
                    clamped = True
                    break
            if not clamped:
                # largest remainder: the bytes rounding down leaves go one each to the shares
                # rounded down the most, so the shares add up to the total
                rem = {}
                for m in free:
                    w = max(0, want.get(m.name, 0))
                    out[m.name] = int(left * w // tw)
                    rem[m.name] = left * w % tw
                spare = left - sum(out[m.name] for m in free)
                for m in sorted(free, key=lambda m: -rem[m.name]):
                    if spare <= 0:
                        break
                    if out[m.name] < m.max_bytes:
                        out[m.name] += 1
                        spare -= 1
                break
        return {m.name: out[m.name] for m in ms}

    def set_total(self, total: int) -> dict:
        """The total changed (the memory floor, a new budget): every share scales by the same
        factor within its bounds. The factor applies to the shares the last move, add or remove
        left, not to the last scaled ones: a shrink that held a model at its minimum (or a
        rounding) does not shift the split once the total grows back. Returns the new shares."""
        self.total = int(total)
        self.step = self._pick_step()
        self.shares = self._fill(self.total, dict(self._base))
        return dict(self.shares)

    def add(self, member: Member) -> dict:
        """A model joins: it gets its weight's part of the total, the others give it back in
        proportion to their shares. Raises SplitError (and changes nothing) when it cannot fit."""
        if member.name in self.members:
            raise SplitError(f"model {member.name} is already served")
        old = dict(self.members)
        self.members[member.name] = member
        try:
            tw = sum(m.weight for m in self.members.values())
            mine = self.total * member.weight / tw
            rest = sum(self.shares.values()) or 1
            want = {n: s * (self.total - mine) / rest for n, s in self.shares.items()}
            want[member.name] = mine
            self.shares = self._fill(self.total, want)
        except SplitError:
            self.members = old
            raise
        self.step = self._pick_step()
        self.table[member.name] = {}
        self._base = dict(self.shares)
        return dict(self.shares)

    def replace(self, member: Member) -> dict:
        """A model's file was re-indexed: ``member`` (same name, new index) takes its place and
        keeps its share as far as its new bounds allow; what it learned is forgotten. Raises
        SplitError (and changes nothing) when the minimums no longer fit."""
        old_member = self.members[member.name]
        self.members[member.name] = member
        try:
            self.shares = self._fill(self.total, dict(self._base))
        except SplitError:
            self.members[member.name] = old_member
            raise
        self.table[member.name] = {}
        self.step = self._pick_step()
        self._base = dict(self.shares)
        return dict(self.shares)

    def remove(self, name: str) -> dict:
        """A model leaves: its share goes to the others in proportion to theirs."""
        self.members.pop(name)
        self.table.pop(name, None)
        self.shares.pop(name, None)
        if self.members:
            self.step = self._pick_step()
            self.shares = self._fill(self.total, dict(self._base))
        self._base = dict(self.shares)
        return dict(self.shares)

    # ---------------------------------------------------------------- ghosts and moves
    def ghost_slots(self, name: str) -> dict:
        """Ghost entries per size class id for ``name`` at its share: the slots one more step
        would add (0 for a class already holding every expert)."""
        m = self.members[name]
        s = self.shares[name]
        now = m.slots(s)
        more = m.slots(s + self.step) if self.step > 0 else now
        return {cid: max(0, more[cid] - now[cid]) for cid in now}

    def _key(self, share: int) -> int:
        return int(share)

    def rebalance(self, ghost_hits: dict) -> tuple | None:
        """One period's ghost hits per model name (models missing count 0): move one step when
        it pays (module docstring). Returns ``(donor, receiver, step)`` when a share moved,
        else None."""
        if self.step <= 0 or len(self.members) < 2:
            return None
        names = list(self.members)
        gain, loss = {}, {}
        for n in names:
            m = self.members[n]
            g = m.weight * int(ghost_hits.get(n, 0))
            gain[n] = g
            self.table[n][self._key(self.shares[n])] = g
            loss[n] = self.table[n].get(self._key(self.shares[n] - self.step), g)
        step = self.step
        # a move is one step, or what is left above the donor's minimum / below the receiver's
        # maximum when that is less
        grow = [n for n in names if self.shares[n] < self.members[n].max_bytes]
        if not grow:
            return None
        r = max(grow, key=lambda n: (gain[n], -names.index(n)))
        shrink = [n for n in names if n != r and self.shares[n] > self.members[n].min_bytes]
        if not shrink:
            return None
        d = min(shrink, key=lambda n: (loss[n], names.index(n)))
        if gain[r] > loss[d] * (1 + self.hysteresis) and gain[r] - loss[d] >= MIN_GAIN:
            move = min(step, self.shares[d] - self.members[d].min_bytes,
                       self.members[r].max_bytes - self.shares[r])
            self.shares[r] += move
            self.shares[d] -= move
            self.moves += 1
            self._base = dict(self.shares)
            return d, r, move
        return None
