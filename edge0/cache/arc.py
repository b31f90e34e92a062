"""ARC (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST 2003).

T1 holds experts seen once recently, T2 experts seen at least twice; B1 and B2 are their ghost
lists (ids only, no weights). The target size p of T1 grows on a B1 ghost hit and shrinks on a
B2 ghost hit. The cases below are numbered as in the paper's Figure 4.

One adaptation: a step routes several experts that must all stay resident, so REPLACE takes the
least recently used *unprotected* entry of the list it chooses, and falls back to the other list
when every entry of the chosen one is protected.
"""

from __future__ import annotations

from collections import OrderedDict

from edge0.cache.policy import Policy


class ARC(Policy):
    name = "arc"

    def __init__(self, capacity: int, num_experts: int):
        super().__init__(capacity, num_experts)
        self.t1: OrderedDict[int, None] = OrderedDict()  # LRU first, MRU last
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.p = 0.0
        self._incoming = None  # (expert, case) of the miss being served
        self._ghost = True  # False only in case IV.A with |T1| = c: the T1 victim leaves no ghost

    def on_hit(self, x: int) -> None:  # case I
        (self.t1 if x in self.t1 else self.t2).pop(x)
        self.t2[x] = None

    def on_miss(self, x: int) -> None:
        c, t1, b1, b2 = self.capacity, self.t1, self.b1, self.b2
        self._ghost = True
        if x in b1:  # case II
            self.p = min(self.p + (1.0 if len(b1) >= len(b2) else len(b2) / len(b1)), c)
            self._incoming = (x, "b1")
        elif x in b2:  # case III
            self.p = max(self.p - (1.0 if len(b2) >= len(b1) else len(b1) / len(b2)), 0.0)
            self._incoming = (x, "b2")
        else:  # case IV
            self._incoming = (x, "new")
            if len(t1) + len(b1) >= c:  # IV.A
                if len(t1) >= c:
                    self._ghost = False
                elif b1:
                    b1.popitem(last=False)
            elif len(t1) + len(self.t2) + len(b1) + len(b2) >= 2 * c and b2:  # IV.B
                b2.popitem(last=False)

    def victim(self, cached: set[int], protected: set[int]) -> int:
        """REPLACE(x, p)."""
        x_in_b2 = self._incoming is not None and self._incoming[1] == "b2"
        t1_free = [e for e in self.t1 if e not in protected]
        t2_free = [e for e in self.t2 if e not in protected]
        from_t1 = len(self.t1) >= 1 and ((x_in_b2 and len(self.t1) == self.p) or len(self.t1) > self.p)
        if from_t1 and t1_free or not t2_free:
            return t1_free[0]
        return t2_free[0]

    def resize(self, capacity: int) -> None:
        """Restore ARC's bounds for the new size c (after the cache dropped its excess): p <= c,
        |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c, dropping the oldest ghosts."""
        super().resize(capacity)
        self.p = min(self.p, float(capacity))
        self._incoming = None
        while self.b1 and len(self.t1) + len(self.b1) > capacity:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * capacity:
            (self.b2 or self.b1).popitem(last=False)

    def on_evict(self, x: int) -> None:
        if x in self.t1:
            self.t1.pop(x)
            if self._ghost:
                self.b1[x] = None
        else:
            self.t2.pop(x)
            self.b2[x] = None

    def on_insert(self, x: int) -> None:
        case = self._incoming[1] if self._incoming and self._incoming[0] == x else "new"
        if case == "b1":
            self.b1.pop(x)
            self.t2[x] = None
        elif case == "b2":
            self.b2.pop(x)
            self.t2[x] = None
        else:
            self.t1[x] = None
        self._incoming, self._ghost = None, True
