"""Kernel specs: the small hashable descriptions every stage passes along.

A spec holds everything that changes the emitted code and nothing else; the target CPU is not
part of it (see runtime/target.py). ``spec.symbol`` is the deterministic name of the exported
kernel, and ``spec.id`` the stable text that keys the object cache.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields


class Spec:
    family: str

    @property
    def symbol(self) -> str:
        parts = []
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool):
                v = int(v)
            elif isinstance(v, tuple):
                v = "x".join(map(str, v))
            parts.append(f"{f.name[0]}{v}" if not isinstance(v, str) else v)
        return "kw_" + self.family + "_" + "_".join(str(p) for p in parts)

    @property
    def id(self) -> str:
        return json.dumps({"family": self.family, **asdict(self)}, sort_keys=True)

    def to_json(self) -> dict:
        return {"family": self.family, **asdict(self)}


@dataclass(frozen=True)
class SortingSpec(Spec):
    """An eager sorting-type kernel: generic over sizes, specialised by op, dtype and flags.

    ``op`` is one of sort, topk, kthvalue, median, nanmedian, median_all, nanmedian_all, mode,
    quantile, nanquantile. ``descending`` folds into the key transform (sort descending, topk
    largest); ``stable`` picks the stable radix sort for sort.
    """
    op: str
    dtype: str
    descending: bool = False
    stable: bool = False
    family = "sorting"

    @property
    def symbol(self) -> str:
        return f"kw_{self.op}_{self.dtype}_d{int(self.descending)}_s{int(self.stable)}"
