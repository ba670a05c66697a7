"""ATen-identical sorting-type ops on Kwker's row kernels.

Each ``fast_*`` function either returns exactly what the ATen CPU kernel returns (values,
indices, strides) or ``NotImplemented`` when the case is not Kwker's: another device, dtype or
layout, an argument ATen rejects (so ATen raises its own error), or an input too small to gain.
Callers (the drop-in overrides, the compile backend) then run ATen themselves.
"""
from __future__ import annotations

import torch

from ..codegen.sortalgo import NETWORK_MAX
from ..codegen.sorting import INTERPOLATIONS
from ..spec import SortingSpec
from .rows import DTYPES, MAX_ROW, DenseOut, OutRows, resize_out, rows_of, run

FLOAT_DTYPES = (torch.float32, torch.float64)
# Below these many elements, or with rows shorter than MIN_ROW, a Kwker call (Python dispatch,
# output allocation, ctypes: ~10 us, plus per-row set-up such as radix histograms) costs more
# than ATen's whole kernel, so ATen runs; crossovers measured on a 2-core Zen 4 over 1-128 rows
# of 16-16384 elements (benchmarks/results/sorting.md has the sweep); kthvalue's, median's and
# mode's as ``thresholds.calibrate`` fits them there (2026-12-06, their out= tensors written in
# place).
MIN_NUMEL = {"topk": 8192, "sort": 8192, "stable": 1024, "kthvalue": 8192, "median": 8192,
             "median_all": 8192, "mode": 8192, "quantile": 0}
# ATen's quantile is a composite of a dozen ops (~25 us even for 8 elements), and Kwker sorts
# short rows instead of bucketing them: it takes every size.
MIN_ROW = {"topk": 1000, "sort": 0, "stable": 512, "kthvalue": 256, "median": 256,
           "median_all": 0, "mode": 256, "quantile": 0}
SPLIT_ROW = 100_000  # a single row at least this long sorts on several threads
# Algorithm switches of the kernels, measured on this CPU by ``thresholds.calibrate``:
# presort: unstable sorts of 32-bit keys radix-sort the row first and run introsort only where
# keys tie (codegen/sort_presorted.py); off: introsort throughout (same answers either way)
SWITCHES = {"presort": True}
# rows from this long whose 32-bit keys vary in every 11-bit digit radix-sort in four byte passes
# instead of three 11-bit ones (codegen/sort_radix.py; 0: never), measured by the same calibration
RADIX_BYTES_ROW = {"row": 8192}


def _dtype_name(x: torch.Tensor) -> str | None:
    if not x.is_cpu or x.layout is not torch.strided:
        return None
    return DTYPES.get(x.dtype)


def _dim(x: torch.Tensor, dim: int) -> int | None:
    nd = x.dim() or 1
    if not -nd <= dim < nd:
        return None
    return dim % nd


def _usable(x: torch.Tensor, dim, family: str, any_size: bool = False):
    """(dtype name, wrapped dim) when Kwker takes this call, else None."""
    name = _dtype_name(x)
    if name is None or x.dim() == 0 or (x.numel() < MIN_NUMEL[family] and not any_size):
        return None
    d = _dim(x, dim)
    if d is None or not 0 < x.shape[d] <= MAX_ROW:
        return None
    # a stable sort of a row of at most NETWORK_MAX elements with 32-bit keys is one sorting
    # network (no radix set-up), so those rows are taken below MIN_ROW["stable"] too
    if x.shape[d] < MIN_ROW[family] and not any_size and not (
            family == "stable" and x.shape[d] <= NETWORK_MAX and x.element_size() <= 4):
        return None
    return name, d


_specs: dict = {}


def _spec(op: str, dtype: str, descending: bool = False, stable: bool = False) -> SortingSpec:
    key = (op, dtype, descending, stable)
    spec = _specs.get(key)
    if spec is None:
        spec = _specs[key] = SortingSpec(op, dtype, descending, stable)
    return spec


# ------------------------------------------------------------------------------------- sort
def fast_sort(x, stable=False, dim=-1, descending=False):
    u = _usable(x, dim, "stable" if stable else "sort")
    if u is None or x.stride(u[1]) == 0:  # stride 0 along dim: ATen keeps arange indices
        return NotImplemented
    name, d = u
    x2, rs, rows, n = rows_of(x, d)
    # §3.1 path 4: 1-D integer ascending sorts of >= 32768 elements take the stable radix path
    radix = (x.dim() == 1 and not descending and not x.dtype.is_floating_point
             and x.numel() >= 32768)
    spec = _spec("sort", name, bool(descending), bool(stable) or radix)
    values = torch.empty_like(x)
    indices = torch.empty_like(x, dtype=torch.int64)
    # one long row: its unstable sort splits over threads after the first partitions
    inner = torch.get_num_threads() if rows == 1 and n >= SPLIT_ROW and not spec.stable else 1
    levels = min(3, (inner - 1).bit_length())  # enough partition levels for one range a thread
    run(spec, x2, rs, rows, n, OutRows(values, d, rows, n), OutRows(indices, d, rows, n),
        (inner, levels, int(SWITCHES["presort"]), RADIX_BYTES_ROW["row"]))
    return values, indices


# ------------------------------------------------------------------------------------- topk
def fast_topk(x, k, dim=-1, largest=True, sorted=True):
    u = _usable(x, dim, "topk")
    if u is None:
        return NotImplemented
    name, d = u
    n = x.shape[d]
    if not 0 < k <= n:
        return NotImplemented
    x2, rs, rows, n = rows_of(x, d)
    shape = list(x.shape)
    shape[d] = k
    values = torch.empty(shape, dtype=x.dtype)
    indices = torch.empty(shape, dtype=torch.int64)
    run(_spec("topk", name, bool(largest)), x2, rs, rows, n,
        OutRows(values, d, rows, k), OutRows(indices, d, rows, k), (k, int(bool(sorted)), 0, 0))
    return values, indices


# ------------------------------------------------------------------- reductions with indices
def _reduced_shape(x, d, keepdim):
    shape = list(x.shape)
    if keepdim:
        shape[d] = 1
    else:
        del shape[d]
    return shape


def _reduce_with_index(op, x, dim, keepdim, param=0, outs=None, usable=None):
    """values, indices of a per-row reduction (kthvalue, median(dim), mode), keepdim applied.

    ``outs``: ATen's fresh (empty) out tensors, which the kernel then writes in place of new
    ones (resized as ATen resizes them; no copy after); ``usable``: ``_usable``'s answer when
    the caller has it."""
    # ATen's median/nanmedian(dim) read expanded (stride-0) inputs wrongly: always take those
    expanded = op in ("median", "nanmedian") and 0 in x.stride()
    u = usable or _usable(x, dim, "median" if op == "nanmedian" else op, any_size=expanded)
    if u is None:
        return NotImplemented
    name, d = u
    x2, rs, rows, n = rows_of(x, d)
    if outs is None:
        kshape = _reduced_shape(x, d, True)
        values = torch.empty(kshape, dtype=x.dtype)
        indices = torch.empty(kshape, dtype=torch.int64)
        out_v, out_i = OutRows(values, d, rows, 1), OutRows(indices, d, rows, 1)
    else:
        reduced = _reduced_shape(x, d, keepdim)
        for t in outs:
            resize_out(t, reduced)
        # one result a row, in the rows' order: a contiguous out is row after row
        out_v, out_i = (DenseOut(t) if t.is_contiguous() else
                        OutRows(t if keepdim else t.unsqueeze(d), d, rows, 1) for t in outs)
    run(_spec(op, name), x2, rs, rows, n, out_v, out_i, (param, 0, 0, 0))
    if outs is not None:
        return tuple(outs)
    if not keepdim:
        values, indices = values.squeeze(d), indices.squeeze(d)
    return values, indices


def fast_kthvalue(x, k, dim=-1, keepdim=False, outs=None):
    u = _usable(x, dim, "kthvalue")
    if u is None or not 1 <= k <= x.shape[u[1]]:
        return NotImplemented
    return _reduce_with_index("kthvalue", x, dim, keepdim, k - 1, outs, u)


def fast_median_dim(x, dim, keepdim=False, ignore_nan=False, outs=None):
    return _reduce_with_index("nanmedian" if ignore_nan else "median", x, dim, keepdim,
                              outs=outs)


def fast_mode(x, dim=-1, keepdim=False):
    return _reduce_with_index("mode", x, dim, keepdim)


def fast_median_all(x, ignore_nan=False):
    name = _dtype_name(x)
    if name is None or x.dim() == 0 or not MIN_NUMEL["median_all"] <= x.numel() <= MAX_ROW:
        return NotImplemented
    # ATen flattens in memory order (a preserve-format clone), which decides ±0 and NaN picks
    if not x.is_contiguous():
        x = x.clone()  # dense, in the input's stride order
    flat = x.as_strided((1, x.numel()), (0, 1))
    value = torch.empty((), dtype=x.dtype)
    index = torch.empty((), dtype=torch.int64)
    op = "nanmedian_all" if ignore_nan else "median_all"
    run(_spec(op, name), flat, 0, 1, flat.shape[1], OutRows(value, 0, 1, 1),
        OutRows(index, 0, 1, 1))
    return value


# ------------------------------------------------------------------------------ quantile
def fast_quantile(x, q, dim=None, keepdim=False, interpolation="linear", ignore_nan=False):
    name = _dtype_name(x)
    if name is None or x.dtype not in FLOAT_DTYPES or x.numel() == 0:
        return NotImplemented
    if interpolation not in INTERPOLATIONS:
        return NotImplemented
    if isinstance(q, torch.Tensor):
        if q.dtype != x.dtype or q.device != x.device or q.dim() > 1 or q.numel() == 0:
            return NotImplemented
        q_t = q.contiguous()
        q_flat = q_t.reshape(-1)
        # q outside [0, 1] or NaN: ATen raises its own error (a few q's check faster in Python)
        if not (all(0 <= v <= 1 for v in q_flat.tolist()) if q_flat.numel() <= 64
                else bool(((q_flat >= 0) & (q_flat <= 1)).all())):
            return NotImplemented
    else:
        if not 0 <= float(q) <= 1:
            return NotImplemented
        q_t = torch.tensor(float(q), dtype=x.dtype)
        q_flat = q_t.reshape(-1)
    if dim is None:
        x2 = x.reshape(1, -1).contiguous()
        rs, rows, n = 0, 1, x2.shape[1]
        reduced = [1] * x.dim() if keepdim else []
    else:
        u = _usable(x, dim, "quantile")
        if u is None:
            return NotImplemented
        _, d = u
        x2, rs, rows, n = rows_of(x, d)
        reduced = _reduced_shape(x, d, keepdim)
    if n > 2**24:
        return NotImplemented
    nq = q_flat.numel()
    # ATen computes (reduced..., q) and moves q to the front: same layout, same strides
    out = torch.empty(list(reduced) + [nq], dtype=x.dtype)
    op = "nanquantile" if ignore_nan else "quantile"
    run(_spec(op, name), x2, rs, rows, n, DenseOut(out, rs=nq), None,
        (q_flat.data_ptr(), nq, INTERPOLATIONS.index(interpolation), 1))
    return out.movedim(-1, 0) if q_t.dim() == 1 else out.squeeze(-1)


# ------------------------------------------------------------------------------ out= helper
def write_out(result, outs):
    """Copy a functional result into ATen-style out tensors (resized as ATen would); a result
    written into them already is returned as it is."""
    if all(src is dst for src, dst in zip(result, outs)):
        return tuple(outs)
    for src, dst in zip(result, outs):
        resize_out(dst, src.shape)
        dst.copy_(src)
    return tuple(outs)
