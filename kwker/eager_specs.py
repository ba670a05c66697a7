"""The generic specialisations behind the eager drop-in kernels.

They are generic over sizes, so this finite list is everything the drop-in path can ever compile
on one CPU: ``kwker-cache prewarm`` compiles exactly these.
"""
from __future__ import annotations

from .spec import SortingSpec

SORT_DTYPES = ("float32", "float64", "int64", "int32", "int16", "int8", "uint8", "float16",
               "bfloat16")
QUANTILE_DTYPES = ("float32", "float64")


def generic_specs() -> list[SortingSpec]:
    specs = []
    for dt in SORT_DTYPES:
        for desc in (False, True):
            specs.append(SortingSpec("sort", dt, desc, False))
            specs.append(SortingSpec("sort", dt, desc, True))
            specs.append(SortingSpec("topk", dt, desc))
        for op in ("kthvalue", "median", "nanmedian", "median_all", "nanmedian_all", "mode"):
            specs.append(SortingSpec(op, dt))
    for dt in QUANTILE_DTYPES:
        specs.append(SortingSpec("quantile", dt))
        specs.append(SortingSpec("nanquantile", dt))
    return specs
