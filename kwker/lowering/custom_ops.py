"""Kwker kernels as opaque ``torch.ops.kwker.*`` custom ops, for ``inner="inductor"``.

Inductor compiles the graph around these ops and calls them as extern kernels. Each op means
exactly the subgraph it replaced, for every size: the real implementation runs the Kwker kernel
specialised to the concrete shapes it is called with (built on first sight and cached), and the
same ATen composition as the original nodes when a kernel does not fit. The fake (meta)
implementation gives the output sizes; outputs are always contiguous, as the fakes say.

Kernels are cached by what they depend on: shapes, flags and the identity and version of the
constant weight they packed, never a process-local handle in the graph, so Inductor's on-disk
graph cache can reuse the compiled graph in another process.
"""
from __future__ import annotations

import logging
import threading
import weakref

import torch
import torch.nn.functional as F

from . import build as B
from .patterns import Match
from .shapes import TensorMeta, contiguous_strides

log = logging.getLogger("kwker")
_lib = torch.library.Library("kwker", "DEF")
_SCHEMAS = {
    "linear": "linear(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, str epilogue, "
              "bool transposed) -> Tensor",
    "linear_topk": "linear_topk(Tensor x, Tensor weight, bool transposed, int k, bool largest) "
                   "-> (Tensor, Tensor)",
    "matmul": "matmul(Tensor a, Tensor b) -> Tensor",
    "gelu": "gelu(Tensor x, str approximate) -> Tensor",
    "sdpa": "sdpa(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float? scale) "
            "-> Tensor",
    "topk": "topk(Tensor x, int k, int dim, bool largest, bool sorted) -> (Tensor, Tensor)",
    "sort": "sort(Tensor x, int dim, bool descending, bool stable) -> (Tensor, Tensor)",
    "kthvalue": "kthvalue(Tensor x, int k, int dim, bool keepdim) -> (Tensor, Tensor)",
    "mode": "mode(Tensor x, int dim, bool keepdim) -> (Tensor, Tensor)",
}
for _schema in _SCHEMAS.values():
    _lib.define(_schema)

_cache: dict = {}
_cache_lock = threading.Lock()
MAX_CACHED = 512


def _version(t):
    try:
        return t._version
    except RuntimeError:
        return None


def kernel_for(key: tuple, consts: dict, make) -> tuple:
    """(kernel, why not) cached under ``key``; ``consts`` are the tensors the kernel packed."""
    entry = _cache.get(key)
    if entry is not None:
        refs, fn, why = entry
        if all(r() is t and (v is None or t._version == v)
               for (r, v), t in zip(refs, consts.values())):
            return fn, why
    try:
        fn, why = make()
    except Exception as e:  # noqa: BLE001 - the op then runs its ATen composition
        log.warning("kwker: building kernel %s failed: %s", key[0], e)
        fn, why = None, f"{type(e).__name__}: {e}"
    refs = [(weakref.ref(t), _version(t)) for t in consts.values()]
    with _cache_lock:
        if len(_cache) >= MAX_CACHED:
            _cache.pop(next(iter(_cache)))
        _cache[key] = (refs, fn, why)
    return fn, why


def _ptr(t):
    return None if t is None else t.data_ptr()


def _shape_meta(shape, dtype=torch.float32):
    if shape is None:
        return None
    shape = tuple(int(s) for s in shape)
    return TensorMeta(shape, contiguous_strides(shape), dtype, "cpu", False)


def _build(kind, key, inputs: dict, metas: dict, params: dict, consts: dict | None = None):
    m = Match(kind, "out", [], inputs, params)
    consts = consts or {}
    return kernel_for((kind, *key), consts, lambda: B.build(m, metas, consts))


# --------------------------------------------------------- kernels by concrete shapes
def linear_kernel(x_shape, weight, bias, res_shape, epilogue, transposed):
    consts = {"w": weight} if bias is None else {"w": weight, "b": bias}
    key = (tuple(x_shape), _ptr(weight), _ptr(bias),
           None if res_shape is None else tuple(res_shape), epilogue, transposed)
    inputs = {"x": "x", "weight": "w", "transposed": transposed,
              "bias": "b" if bias is not None else None,
              "residual": "r" if res_shape is not None else None}
    metas = {"x": _shape_meta(x_shape), "r": _shape_meta(res_shape)}
    return _build("linear", key, inputs, metas, {"epilogue": epilogue}, consts)


def linear_topk_kernel(x_shape, weight, transposed, k, largest):
    return _build("linear_topk", (tuple(x_shape), _ptr(weight), transposed, k, largest),
                  {"x": "x", "weight": "w", "transposed": transposed},
                  {"x": _shape_meta(x_shape)}, {"k": k, "largest": largest}, {"w": weight})


def matmul_kernel(a_shape, b_shape):
    return _build("matmul", (tuple(a_shape), tuple(b_shape)), {"a": "a", "b": "b"},
                  {"a": _shape_meta(a_shape), "b": _shape_meta(b_shape)}, {})


def gelu_kernel(numel, approximate):
    return _build("gelu", (numel, approximate), {"x": "x"}, {"x": _shape_meta((numel,))},
                  {"approximate": approximate})


def sdpa_kernel(q_shape, k_shape, v_shape, mask_shape, mask_kind, causal, scale):
    key = (tuple(q_shape), tuple(k_shape), tuple(v_shape),
           None if mask_shape is None else tuple(mask_shape), mask_kind, causal, scale)
    inputs = {"q": "q", "k": "k", "v": "v", "mask": None if mask_shape is None else "m"}
    metas = {"q": _shape_meta(q_shape), "k": _shape_meta(k_shape), "v": _shape_meta(v_shape),
             "m": _shape_meta(mask_shape)}
    return _build("sdpa", key, inputs, metas,
                  {"causal": causal, "scale": scale, "mask": mask_kind})


# ------------------------------------------------------------- real and fake impls
def _act(out, epilogue):
    if epilogue == "relu":
        return torch.relu(out)
    if epilogue in ("gelu", "gelu_tanh"):
        return F.gelu(out, approximate="none" if epilogue == "gelu" else "tanh")
    return out


def _linear(x, weight, bias, residual, epilogue, transposed):
    fn, _ = linear_kernel(x.shape, weight, bias, None if residual is None else residual.shape,
                          epilogue, transposed)
    if fn is not None:
        return (fn(x) if residual is None else fn(x, residual)).contiguous()
    out = _act(F.linear(x, weight.t() if transposed else weight, bias), epilogue)
    return (out if residual is None else out + residual).contiguous()


def _linear_fake(x, weight, bias, residual, epilogue, transposed):
    n = weight.shape[1] if transposed else weight.shape[0]
    shape = (*x.shape[:-1], n)
    if residual is not None:
        shape = torch.broadcast_shapes(shape, residual.shape)
    return x.new_empty(shape)


def _linear_topk(x, weight, transposed, k, largest):
    fn, _ = linear_topk_kernel(x.shape, weight, transposed, k, largest)
    if fn is not None:
        return tuple(t.contiguous() for t in fn(x))
    scores = torch.matmul(x, weight if transposed else weight.t())
    v, i = torch.topk(scores, k, -1, largest, True)
    return v.contiguous(), i.contiguous()


def _linear_topk_fake(x, weight, transposed, k, largest):
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int64)


def _matmul(a, b):
    fn, _ = matmul_kernel(a.shape, b.shape)
    return (fn(a, b) if fn is not None else torch.matmul(a, b)).contiguous()


def _matmul_fake(a, b):
    if b.dim() == 2:
        return a.new_empty((*a.shape[:-1], b.shape[-1]))
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return a.new_empty((*batch, a.shape[-2], b.shape[-1]))


def _gelu(x, approximate):
    if x.is_contiguous():
        fn, _ = gelu_kernel(x.numel(), approximate)
        if fn is not None:
            return fn(x).contiguous()
    return F.gelu(x, approximate=approximate).contiguous()


def _gelu_fake(x, approximate):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _sdpa(q, k, v, mask, causal, scale):
    kind = None if mask is None else ("bool" if mask.dtype == torch.bool else "float")
    fn, _ = sdpa_kernel(q.shape, k.shape, v.shape, None if mask is None else mask.shape, kind,
                        causal, scale)
    if fn is not None:
        return (fn(q, k, v) if mask is None else fn(q, k, v, mask)).contiguous()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          scale=scale).contiguous()


def _sdpa_fake(q, k, v, mask, causal, scale):
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    return q.new_empty((*batch, q.shape[-2], v.shape[-1]))


def _aten_sorting(op, x, *args):
    if op == "sort":
        dim, descending, stable = args
        return torch.ops.aten.sort.stable(x, stable=stable, dim=dim, descending=descending)
    return getattr(torch.ops.aten, op).default(x, *args)


def _sorting(op):
    def impl(x, *args):
        mod = B.sorting_module()
        fn = getattr(mod, op, None) if mod is not None else None
        return tuple(fn(x, *args) if fn is not None else _aten_sorting(op, x, *args))

    def fake(x, *args):
        return tuple(_aten_sorting(op, x, *args))
    return impl, fake


_IMPLS = {"linear": (_linear, _linear_fake), "linear_topk": (_linear_topk, _linear_topk_fake),
          "matmul": (_matmul, _matmul_fake), "gelu": (_gelu, _gelu_fake),
          "sdpa": (_sdpa, _sdpa_fake)}
for _op in ("topk", "sort", "kthvalue", "mode"):
    _IMPLS[_op] = _sorting(_op)
for _name, (_impl, _fake) in _IMPLS.items():
    _lib.impl(_name, _impl, "CPU")
    torch.library.register_fake(f"kwker::{_name}", _fake, lib=_lib)


def op(name: str):
    """The OpOverload ``torch.ops.kwker.<name>.default``."""
    return getattr(torch.ops.kwker, name).default
