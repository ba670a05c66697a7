"""Nested collectors: code deep in a call tree reports what it used (the kernel specs a graph
built, the tuning records its lowering read) to whoever asked, without a list passed through
every call. Per thread; an inner collection's items also reach the one around it."""
from __future__ import annotations

import contextlib
import threading


class Collector:
    def __init__(self):
        self._local = threading.local()

    def active(self) -> list | None:
        """The innermost open collection of this thread, or None."""
        return getattr(self._local, "items", None)

    def add(self, item) -> None:
        items = self.active()
        if items is not None:
            items.append(item)

    @contextlib.contextmanager
    def collecting(self):
        """Yield the list of the items added inside."""
        outer = self.active()
        self._local.items = items = []
        try:
            yield items
        finally:
            self._local.items = outer
            if outer is not None:
                outer.extend(items)
