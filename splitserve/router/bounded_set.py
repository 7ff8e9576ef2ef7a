"""A set that remembers at most a bound of items, the oldest forgotten first: what the router keeps
per discovery record, per value it refused, per worker id an operator removed, so that nothing a
writer of etcd or a caller does grows the router without bound."""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable


class BoundedSet:
    def __init__(self, bound: int):
        self.bound = max(1, bound)
        self._items: OrderedDict = OrderedDict()
        self.forgotten = 0  # items dropped to keep the bound

    def add(self, item: Hashable) -> bool:
        """Remember ``item`` (as the newest); whether it was not remembered already."""
        if item in self._items:
            self._items.move_to_end(item)
            return False
        self._items[item] = None
        while len(self._items) > self.bound:
            self._items.popitem(last=False)
            self.forgotten += 1
        return True

    def discard(self, item: Hashable) -> bool:
        """Forget ``item``; whether it was remembered."""
        return self._items.pop(item, 0) is None

    def __contains__(self, item: Hashable) -> bool:
        return item in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(list(self._items))
