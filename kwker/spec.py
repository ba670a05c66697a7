"""Kernel specs: the small hashable descriptions every stage passes along.

A spec holds everything that changes the emitted code and nothing else; the target CPU is not
part of it (see runtime/target.py). ``spec.symbol`` is the deterministic name of the exported
kernel, and ``spec.id`` the stable text that keys the object cache.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

SPEC_CLASSES: dict[str, type] = {}


def register_spec(cls):
    """Make a spec class known to ``spec_from_json`` (manifests, ``kwker-cache prewarm``)."""
    SPEC_CLASSES[cls.family] = cls
    return cls


def spec_from_json(data: dict) -> Spec:
    data = dict(data)
    cls = SPEC_CLASSES[data.pop("family")]
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


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


@register_spec
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
