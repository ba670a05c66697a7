"""Kwker kernels as opaque ``torch.ops.kwker.*`` custom ops, for ``inner="inductor"``.

Inductor compiles the graph around these ops and calls them as extern kernels. Each op means
exactly the subgraph it replaced, for every size: the real implementation runs the Kwker kernel
specialised to the concrete shapes it is called with when the compile built one (static
shapes), else the kernel generic over the sizes that vary (rows, batch, sequence lengths; built
at compile time for a graph with symbolic sizes, at worst once per op, never once per size), and
the same ATen composition as the original nodes when no kernel fits. The fake (meta)
implementation gives the output sizes, symbolic ones included; outputs are always contiguous,
as the fakes say.

Kernels are cached by what they depend on: shapes, flags and the identity and version of the
constant weight they packed, never a process-local handle in the graph, so Inductor's on-disk
graph cache can reuse the compiled graph in another process.
"""
from __future__ import annotations

import logging
import math
import threading
import weakref

import torch
import torch.nn.functional as F

from ..kernels._call import float32_precision
from ..kernels.grouped import grouped_linear_aten
from ..kernels.rope import rotate_half_rope
from . import build as B
from . import sorting as S
from .build_attention import written_attention_aten
from .generic import generic_shapes
from .grouped import expert_weights
from .make import make_kernel
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
    "layer_norm": "layer_norm(Tensor x, Tensor? weight, Tensor? bias, int d, float eps, "
                  "str norm, ScalarType? out_dtype=None, float offset=0.0) -> Tensor",
    "silu_mul": "silu_mul(Tensor x, Tensor y) -> Tensor",
    "rope": "rope(Tensor x, Tensor cos, Tensor sin) -> Tensor",
    "grouped_mm": "grouped_mm(Tensor x, Tensor weight, Tensor offs, bool transposed) -> Tensor",
    "sdpa": "sdpa(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float? scale, "
            "bool written=False, float? fill=None) -> Tensor",
}
_PAIR, _QUANTILE = "-> (Tensor, Tensor)", "int? dim, bool keepdim, str interpolation) -> Tensor"
_SORTING = {  # variant (see sorting.py) -> schema
    "topk": f"(Tensor x, int k, int dim, bool largest, bool sorted) {_PAIR}",
    "sort": f"(Tensor x, int dim, bool descending, bool stable) {_PAIR}",
    "argsort": "(Tensor x, int dim, bool descending, bool stable) -> Tensor",
    "msort": "(Tensor x) -> Tensor",
    "kthvalue": f"(Tensor x, int k, int dim, bool keepdim) {_PAIR}",
    "mode": f"(Tensor x, int dim, bool keepdim) {_PAIR}",
    "median_dim": f"(Tensor x, int dim, bool keepdim) {_PAIR}",
    "nanmedian_dim": f"(Tensor x, int dim, bool keepdim) {_PAIR}",
    "median_all": "(Tensor x) -> Tensor",
    "nanmedian_all": "(Tensor x) -> Tensor",
    "quantile": f"(Tensor x, Tensor q, {_QUANTILE}",
    "nanquantile": f"(Tensor x, Tensor q, {_QUANTILE}",
    "quantile_scalar": f"(Tensor x, float q, {_QUANTILE}",
    "nanquantile_scalar": f"(Tensor x, float q, {_QUANTILE}",
}
_SCHEMAS.update({name: name + schema for name, schema in _SORTING.items()})
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


def kernel_for(key: tuple, consts: tuple, make, build: bool = True) -> tuple:
    """(kernel, why not) cached under ``key``; ``consts`` are the tensors the kernel packed.

    A hit costs the dict lookup and, per constant, one weakref call and a version read; the
    kernel is built (``make()``) only on a miss or when a constant changed, and with
    ``build=False`` not at all: (None, None) then.
    """
    entry = _cache.get(key)
    if entry is not None:
        refs, fn, why = entry
        for (r, v), t in zip(refs, consts):
            if r() is not t or (v is not None and t._version != v):
                break
        else:
            return fn, why
    if not build:
        return None, None
    try:
        fn, why = make()
    except Exception as e:  # noqa: BLE001 - the op then runs its ATen composition
        log.warning("kwker: building kernel %s failed: %s", key[0], e)
        fn, why = None, f"{type(e).__name__}: {e}"
    refs = [(weakref.ref(t), _version(t)) for t in consts]
    with _cache_lock:
        if len(_cache) >= MAX_CACHED:
            _cache.pop(next(iter(_cache)))
        _cache[key] = (refs, fn, why)
    return fn, why


def _ptr(t):
    return None if t is None else t.data_ptr()


def _shape_meta(shape, dtype=torch.float32, stride=None):
    """Metadata for a builder; None sizes (and then strides) are read at call time."""
    if shape is None:
        return None
    if any(s is None for s in shape):
        return TensorMeta(tuple(shape), (None,) * len(shape), dtype, "cpu", False)
    shape = tuple(int(s) for s in shape)
    stride = contiguous_strides(shape) if stride is None else tuple(int(s) for s in stride)
    return TensorMeta(shape, stride, dtype, "cpu", False)


def _make(kind, inputs: dict, shapes: dict, params: dict, consts: dict | None = None,
          strides: dict | None = None, dtype: torch.dtype = torch.float32,
          dtypes: dict | None = None):
    """Build a kernel for ``kind`` at these shapes (called by kernel_for on a miss only);
    ``strides`` gives some inputs' layouts (contiguous otherwise; "out" is the result's);
    ``dtype`` is the activations' (a mask's meta gets it too: only its shape is read), unless
    ``dtypes`` names another for an input."""
    strides, dtypes = strides or {}, dtypes or {}
    metas = {k: _shape_meta(v, dtype=dtypes.get(k, dtype), stride=strides.get(k))
             for k, v in shapes.items()}
    return B.build(Match(kind, "out", [], inputs, params), metas, consts or {})


# --------------------------------------------------------- kernels by concrete shapes
def linear_kernel(x_shape, weight, bias, res_shape, epilogue, transposed,
                  dtype=torch.float32, build=True, res_dtype=None):
    """``dtype``: the activations' (x, residual, out); a float32 weight is rounded to it.
    ``res_dtype``: the residual's, and then the output's, when not ``dtype`` (float32 with
    bf16). None sizes in the shapes: the kernel generic over them (see
    ``build.generic_shapes``)."""
    res_dtype = res_dtype or dtype
    # (a torch.Size and the tuple of its sizes are the same key; the float32 matmul precision
    # picks a float32 kernel's products, make_linear)
    key = ("linear", x_shape, weight.data_ptr(), _ptr(bias), res_shape, epilogue, transposed,
           dtype, res_dtype, float32_precision())
    return kernel_for(key, (weight,) if bias is None else (weight, bias), lambda: _make(
        "linear", {"x": "x", "weight": "w", "transposed": transposed,
                   "bias": "b" if bias is not None else None,
                   "residual": "r" if res_shape is not None else None},
        {"x": x_shape, "r": res_shape}, {"epilogue": epilogue}, {"w": weight, "b": bias},
        dtype=dtype, dtypes={"r": res_dtype}), build)


def linear_topk_kernel(x_shape, weight, transposed, k, largest, dtype=torch.float32,
                       build=True):
    key = ("linear_topk", x_shape, weight.data_ptr(), transposed, k, largest, dtype)
    return kernel_for(key, (weight,), lambda: _make(
        "linear_topk", {"x": "x", "weight": "w", "transposed": transposed}, {"x": x_shape},
        {"k": k, "largest": largest}, {"w": weight}, dtype=dtype), build)


def matmul_kernel(a_shape, b_shape, dtype=torch.float32, build=True, b_transposed=False):
    """``b_transposed`` (generic kernels): b arrives as ``c.mT`` of a contiguous ``c``."""
    key = ("matmul", tuple(a_shape), tuple(b_shape), dtype, b_transposed)
    return kernel_for(key, (), lambda: _make(
        "matmul", {"a": "a", "b": "b"}, {"a": a_shape, "b": b_shape},
        {"b_transposed": b_transposed}, dtype=dtype), build)


def grouped_mm_kernel(weight, transposed, dtype=torch.float32, build=True):
    """Generic over the rows: the runs change with every call's routing."""
    key = ("grouped_mm", weight.data_ptr(), tuple(weight.shape), transposed, dtype,
           float32_precision())
    return kernel_for(key, (weight,), lambda: _make(
        "grouped_mm", {"x": "x", "weight": "w", "offs": "o", "transposed": transposed},
        {"x": (None, weight.shape[2 if transposed else 1]), "o": (weight.shape[0],)}, {},
        {"w": weight}, dtype=dtype, dtypes={"o": torch.int64}), build)


def gelu_kernel(numel, approximate, dtype=torch.float32, build=True):
    return kernel_for(("gelu", numel, approximate, dtype), (), lambda: _make(
        "gelu", {"x": "x"}, {"x": (numel,)}, {"approximate": approximate}, dtype=dtype), build)


def silu_mul_kernel(numel, dtype=torch.float32, build=True):
    return kernel_for(("silu_mul", numel, dtype), (), lambda: _make(
        "silu_mul", {"x": "x", "y": "y"}, {"x": (numel,), "y": (numel,)}, {}, dtype=dtype),
        build)


def layer_norm_kernel(x_shape, weight, bias, eps, dtype=torch.float32, build=True,
                      norm="layer", out_dtype=None, offset=0.0):
    """``out_dtype``: bf16 for float32 x, autocast's cast after the norm done by the kernel.
    ``offset``: the weight is ``weight + offset`` in float32 (Gemma's RMSNorm)."""
    key = ("layer_norm", tuple(x_shape), _ptr(weight), _ptr(bias), eps, dtype, norm, out_dtype,
           offset)
    consts = tuple(t for t in (weight, bias) if t is not None)
    params = {"d": x_shape[-1], "eps": eps, "norm": norm, "out": out_dtype}
    if offset:
        params["offset"] = offset
    return kernel_for(key, consts, lambda: _make(
        "layer_norm", {"x": "x", "weight": "w" if weight is not None else None,
                       "bias": "b" if bias is not None else None}, {"x": x_shape},
        params, {"w": weight, "b": bias}, dtype=dtype), build)


def sdpa_kernel(q_shape, k_shape, v_shape, mask_shape, mask_kind, causal, scale,
                qkv_strides=(None, None, None), dtype=torch.float32, build=True,
                written=False, fill=-math.inf):
    """``qkv_strides``: the layouts q, k, v arrive in (read in place by a specialised kernel;
    a generic one reads them per call); the result is contiguous, as the fake says.
    ``written``: attention written out (see make_sdpa)."""
    generic = any(d is None for d in q_shape)
    if generic:
        qkv_strides = (None, None, None)
    key = ("sdpa", tuple(q_shape), tuple(k_shape), tuple(v_shape),
           None if mask_shape is None else tuple(mask_shape), mask_kind, causal, scale,
           qkv_strides, dtype, written, fill)
    out_shape = (*q_shape[:-1], v_shape[-1])
    return kernel_for(key, (), lambda: _make(
        "sdpa", {"q": "q", "k": "k", "v": "v", "mask": None if mask_shape is None else "m"},
        {"q": q_shape, "k": k_shape, "v": v_shape, "m": mask_shape, "out": out_shape},
        {"causal": causal, "scale": scale, "mask": mask_kind, "written": written, "fill": fill},
        strides=dict(zip("qkv", qkv_strides)), dtype=dtype), build)


# ------------------------------------------------------------- real and fake impls
def _act(out, epilogue):
    if epilogue == "relu":
        return torch.relu(out)
    if epilogue in ("silu", "sigmoid", "tanh"):
        return getattr(F, epilogue)(out)
    if epilogue in ("gelu", "gelu_tanh"):
        return F.gelu(out, approximate="none" if epilogue == "gelu" else "tanh")
    return out


def _linear(x, weight, bias, residual, epilogue, transposed):
    rs, rd = (None, None) if residual is None else (residual.shape, residual.dtype)
    fn, _ = linear_kernel(x.shape, weight, bias, rs, epilogue, transposed, x.dtype, False, rd)
    if fn is None:
        g = generic_shapes("linear", {"x": x.shape, "r": rs})
        fn, _ = linear_kernel(g["x"], weight, bias, g["r"], epilogue, transposed, x.dtype,
                              res_dtype=rd)
    if fn is not None:
        return fn(x) if residual is None else fn(x, residual)  # contiguous, as the fake says
    weight = weight.to(x.dtype)  # an autocast region's float32 weight, cast as autocast casts
    bias = None if bias is None else bias.to(x.dtype)
    out = _act(F.linear(x, weight.t() if transposed else weight, bias), epilogue)
    return (out if residual is None else out + residual).contiguous()


def _linear_fake(x, weight, bias, residual, epilogue, transposed):
    n = weight.shape[1] if transposed else weight.shape[0]
    shape = (*x.shape[:-1], n)
    if residual is not None:  # a float32 residual of a bf16 product: a float32 sum
        return x.new_empty(torch.broadcast_shapes(shape, residual.shape),
                           dtype=torch.promote_types(x.dtype, residual.dtype))
    return x.new_empty(shape)


def _linear_topk(x, weight, transposed, k, largest):
    fn, _ = linear_topk_kernel(x.shape, weight, transposed, k, largest, x.dtype, False)
    if fn is None:
        g = generic_shapes("linear_topk", {"x": x.shape})["x"]
        fn, _ = linear_topk_kernel(g, weight, transposed, k, largest, x.dtype)
    if fn is not None:
        return tuple(fn(x))
    weight = weight.to(x.dtype)  # an autocast region's float32 weight, cast as autocast casts
    scores = torch.matmul(x, weight if transposed else weight.t())
    v, i = torch.topk(scores, k, -1, largest, True)
    return v.contiguous(), i.contiguous()


def _linear_topk_fake(x, weight, transposed, k, largest):
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int64)


def _matmul(a, b):
    fn, _ = matmul_kernel(a.shape, b.shape, a.dtype, False)
    if fn is None:
        g = generic_shapes("matmul", {"a": a.shape, "b": b.shape})
        fn, _ = matmul_kernel(g["a"], g["b"], a.dtype, b_transposed=transposed_view(b))
    return fn(a, b) if fn is not None else torch.matmul(a, b).contiguous()


def _matmul_fake(a, b):
    if b.dim() == 2:
        return a.new_empty((*a.shape[:-1], b.shape[-1]))
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return a.new_empty((*batch, a.shape[-2], b.shape[-1]))


def _grouped_mm(x, weight, offs, transposed):
    fn, _ = grouped_mm_kernel(weight, transposed, x.dtype)
    if fn is not None:
        return fn(x, offs)
    return grouped_linear_aten(x, expert_weights(weight, transposed).to(x.dtype), offs)


def _grouped_mm_fake(x, weight, offs, transposed):
    return x.new_empty((x.shape[0], weight.shape[1 if transposed else 2]))


def _gelu(x, approximate):
    if x.is_contiguous():
        fn, _ = gelu_kernel(x.numel(), approximate, x.dtype, False)
        if fn is None:
            fn, _ = gelu_kernel(None, approximate, x.dtype)
        if fn is not None:
            return fn(x)
    return F.gelu(x, approximate=approximate).contiguous()


def _gelu_fake(x, approximate):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _silu_mul(x, y):
    if x.is_contiguous() and y.is_contiguous():
        fn, _ = silu_mul_kernel(x.numel(), x.dtype, False)
        if fn is None:
            fn, _ = silu_mul_kernel(None, x.dtype)
    else:   # rows a stride apart (a chunk's halves): the row kernel, built on first use
        fn, _ = kernel_for(("silu_mul_rows", x.dtype), (),
                           lambda: make_kernel("make_silu_mul_rows", dtype=x.dtype))
    if fn is not None:
        return fn(x, y)
    return (F.silu(x) * y).contiguous()


def _silu_mul_fake(x, y):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def rope_kernel(d, dtype=torch.float32, build=True, x_dtype=None):
    """``dtype``: cos's and sin's (and the result's); ``x_dtype``: x's when not that."""
    return kernel_for(("rope", d, dtype, x_dtype), (), lambda: _make(
        "rope", {"x": "x", "cos": "c", "sin": "s"},
        {"x": (None, None, None, d), "c": (None, None, None, d), "s": (None, None, None, d)},
        {"d": d}, dtype=dtype, dtypes={"x": x_dtype or dtype}), build)


def _rope(x, cos, sin):
    fn, _ = rope_kernel(x.shape[-1], cos.dtype, x_dtype=x.dtype) \
        if x.dim() == 4 and x.shape[-1] % 2 == 0 else (None, None)
    if fn is not None:
        return fn(x, cos, sin)   # other layouts: the ATen composition, inside
    return rotate_half_rope(x, cos, sin)


def _rope_fake(x, cos, sin):   # eager's layout (x's) and type (promoted)
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, cos.dtype))


def _layer_norm(x, weight, bias, d, eps, norm, out_dtype=None, offset=0.0):
    fn = None
    if x.is_contiguous():
        fn, _ = layer_norm_kernel(x.shape, weight, bias, eps, x.dtype, False, norm, out_dtype,
                                  offset)
        if fn is None:
            g = generic_shapes("layer_norm", {"x": x.shape})["x"]
            fn, _ = layer_norm_kernel(g, weight, bias, eps, x.dtype, True, norm, out_dtype,
                                      offset)
    if fn is not None:
        return fn(x)
    return B.norm_aten(norm, d, B.offset_weight(weight, offset), bias, eps,
                       out_dtype)(x).contiguous()


def _layer_norm_fake(x, weight, bias, d, eps, norm, out_dtype=None, offset=0.0):
    return torch.empty_like(x, memory_format=torch.contiguous_format, dtype=out_dtype or x.dtype)


def _sdpa(q, k, v, mask, causal, scale, written=False, fill=None):
    fill = -math.inf if fill is None else fill   # (the schema has no -inf default)
    kind = None if mask is None else ("float" if mask.dtype != torch.bool else
                                      "fill" if written else "bool")
    ms = None if mask is None else mask.shape
    fn, _ = sdpa_kernel(q.shape, k.shape, v.shape, ms, kind, causal, scale,
                        (q.stride(), k.stride(), v.stride()), q.dtype, False, written, fill)
    if fn is None:
        g = generic_shapes("sdpa", {"q": q.shape, "k": k.shape, "v": v.shape, "m": ms})
        fn, _ = sdpa_kernel(g["q"], g["k"], g["v"], g["m"], kind, causal, scale,
                            dtype=q.dtype, written=written, fill=fill)
    if fn is not None:
        return (fn(q, k, v) if mask is None else fn(q, k, v, mask)).contiguous()
    if written:
        return written_attention_aten(q, k, v, mask, scale, fill)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=_gqa(q, k)).contiguous()


def transposed_view(b) -> bool:
    """Whether ``b`` is ``c.mT`` of a contiguous ``c`` (``q @ k.mT``): read as is, no copy."""
    return b.dim() >= 2 and not b.is_contiguous() and b.mT.is_contiguous()


def _gqa(q, k) -> bool:
    """Fewer k/v heads than query heads: grouped-query attention (the op means ATen's
    ``enable_gqa=True`` then)."""
    return q.dim() == 4 and k.shape[-3] != q.shape[-3]


def _sdpa_fake(q, k, v, mask, causal, scale, written=False, fill=None):
    if _gqa(q, k):
        return q.new_empty((*q.shape[:-1], v.shape[-1]))
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    return q.new_empty((*batch, q.shape[-2], v.shape[-1]))


def _sorting(v):
    def impl(x, *args):
        mod = S.module()
        out = S.run(mod, v, x, *args) if mod is not None else S.aten(v, x, *args)
        return tuple(out) if isinstance(out, tuple) else out

    def fake(x, *args):
        out = S.aten(v, x, *args)
        return tuple(out) if isinstance(out, tuple) else out
    return impl, fake


_IMPLS = {"linear": (_linear, _linear_fake), "linear_topk": (_linear_topk, _linear_topk_fake),
          "matmul": (_matmul, _matmul_fake), "gelu": (_gelu, _gelu_fake),
          "sdpa": (_sdpa, _sdpa_fake), "layer_norm": (_layer_norm, _layer_norm_fake),
          "silu_mul": (_silu_mul, _silu_mul_fake), "rope": (_rope, _rope_fake),
          "grouped_mm": (_grouped_mm, _grouped_mm_fake)}
for _v in _SORTING:
    _IMPLS[_v] = _sorting(_v)
for _name, (_impl, _fake) in _IMPLS.items():
    _lib.impl(_name, _impl, "CPU")
    torch.library.register_fake(f"kwker::{_name}", _fake, lib=_lib)


def op(name: str):
    """The OpOverload ``torch.ops.kwker.<name>.default``."""
    return getattr(torch.ops.kwker, name).default
