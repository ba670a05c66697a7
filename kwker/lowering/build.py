"""Matches + concrete sizes -> callables running Kwker kernels (the eager runner's steps).

Each builder checks that the concrete shapes fit its kernel, calls the kernel factory of
``kwker.kernels`` (which compiles or loads the code and packs constant weights once), and wraps
it in the reshapes that bring the FX node's tensors to the kernel's 2-D/4-D contiguous contract.
A builder returns ``(callable, None)`` or ``(None, reason)``; a factory that is missing or raises
``NotImplementedError`` leaves the nodes to ATen with that reason in the report.

Sizes that are not ints (dynamo's symbolic sizes, or None from a custom op asking for the generic
kernel) are read at call time: the builder asks the factory for the kernel generic over them
(GEMM rows and batch, attention batch and lengths, elementwise length) and its reshapes take
their sizes from the tensors. Sizes that are ints specialise the kernel.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch.fx import Node

from ..kernels.linear_lowbit import is_quantized
from ..runtime import kernel
from . import sorting as S
from .build_attention import build_sdpa
from .generic import SHORT_NAMES, SIZED_INPUTS, generic_shapes, pinned
from .grouped import expert_weights
from .make import collecting, known, make_kernel, mark_generic
from .patterns import Match
from .shapes import TensorMeta, contiguous_strides, same_layout


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def build(m: Match, metas: dict, consts: dict):
    """(callable taking the match's runtime inputs in ``runtime_inputs(m)`` order, or None, reason).

    The callable carries ``kwker_specs``, the specs of the kernels it calls. For static sizes
    the kernel specialised to them is taken when it needs no compile (built before, or in the
    disk cache), else the generic one when that needs none, else the specialised one is
    compiled (the op's first kernel: a compile is due anyway). So a size dynamo specialises on
    its own (it does for 1) never waits for a compile once a generic kernel exists.
    """
    with collecting() as specs:
        fn, why = _build_without_stall(m, metas, consts)
    if fn is not None:
        fn.kwker_specs = list(specs)
    return fn, why


_specialising = threading.local()


@contextlib.contextmanager
def specialising():
    """Static sizes always get their size-specialised kernels inside (ahead-of-time packages:
    the compile happens now, not in a caller's first call, so the no-stall rule has no cause)."""
    outer = getattr(_specialising, "on", False)
    _specialising.on = True
    try:
        yield
    finally:
        _specialising.on = outer


def _build_without_stall(m: Match, metas: dict, consts: dict):
    builder = _BUILDERS[m.kind]
    wide = _generic_match(m, metas)
    if wide is None or getattr(_specialising, "on", False):
        return builder(m, metas, consts)
    try:  # a refusal (the sizes do not fit, ATen is faster) stands as it is
        with kernel.compiling(False):
            return builder(m, metas, consts)
    except kernel.NotCompiled:
        pass
    try:
        with kernel.compiling(False):
            fn, why = builder(wide[0], wide[1], consts)
        if fn is not None:
            fn.kwker_stand_in = True   # for a size it was not built for (tune.verdict)
            return fn, why
    except kernel.NotCompiled:
        pass
    return builder(m, metas, consts)


def _generic_match(m: Match, metas: dict):
    """(match, metas) asking for the generic kernel of a match with static sizes, or None."""
    keys = SIZED_INPUTS.get(m.kind)
    if keys is None:
        return None
    nodes = {k: m.inputs[k] for k in keys if m.inputs.get(k) is not None}
    if not all(isinstance(metas.get(n), TensorMeta) and known(*metas[n].shape)
               for n in nodes.values()):
        return None
    shapes = generic_shapes(m.kind, {SHORT_NAMES.get(k, k): metas[n].shape
                                     for k, n in nodes.items()})
    wide = dict(metas)
    for k, n in nodes.items():
        shape = shapes[SHORT_NAMES.get(k, k)]
        wide[n] = TensorMeta(shape, (None,) * len(shape), metas[n].dtype, metas[n].device,
                             False)
    params = m.params
    if m.kind == "matmul":  # the layout of b, which the generic metadata no longer shows
        params = {**params, "b_transposed": transposed_view(metas[nodes["b"]])}
    return Match(m.kind, m.output, m.covers, m.inputs, params), wide


# the inputs of kernels generic over every size (none of their sizes keys a kernel)
GENERIC_INPUTS = {"rope": ("x", "cos", "sin")}


def runtime_inputs(m: Match) -> list:
    """Nodes the kernel reads at run time, in the order its callable takes them."""
    # sorting: x, then a quantile's q tensor
    keys = SIZED_INPUTS.get(m.kind) or GENERIC_INPUTS.get(m.kind, ("x",))
    nodes = [m.inputs[k] for k in keys if m.inputs.get(k) is not None]
    if m.kind == "sorting":
        nodes += [a for a in m.params["args"] if isinstance(a, Node)]
    return nodes


def _weight(m: Match, consts: dict) -> torch.Tensor:
    w = consts[m.inputs["weight"]].detach()
    return w.t().contiguous() if m.inputs["transposed"] else w


def _linear(m: Match, metas, consts):
    xm: TensorMeta = metas[m.inputs["x"]]
    source = consts[m.inputs["weight"]]
    if is_quantized(source):  # torchao's int8/int4 weights: the low-bit GEMV family
        if m.inputs["transposed"]:
            return None, f"a transposed {type(source).__name__} weight"
        maker, w, extra = "make_linear_lowbit", source, {}
    else:
        maker, w, extra = "make_linear", _weight(m, consts), {"source": source}
    n_out, k_in = w.shape
    if xm.shape[-1] != k_in:
        return None, f"input has {xm.shape[-1]} features, weight expects {k_in}"
    lead = xm.shape[:-1]
    out_shape = (*lead, n_out)
    res = m.inputs["residual"]
    if res is not None:
        rm = metas[res]
        if len(rm.shape) != len(out_shape) or not all(
                a is None or b is None or a == b for a, b in zip(rm.shape, out_shape)):
            return None, f"residual shape {rm.shape} is not the output shape {out_shape}"
        if rm.dtype != xm.dtype:  # a float32 residual stream (autocast): a float32 result
            if maker != "make_linear":
                return None, f"a {rm.dtype} residual of a {xm.dtype} low-bit linear"
            extra["out_dtype"] = rm.dtype
    bias = consts[m.inputs["bias"]].detach() if m.inputs["bias"] is not None else None
    if not known(*lead):
        fn, why = make_kernel(maker, w, bias, None, epilogue=m.params["epilogue"],
                              residual=res is not None, dtype=xm.dtype, **extra)
        # generic kernels take x and the residual with their leading dims as they are
        return mark_generic(fn, True), why
    rows = _prod(lead)
    if rows == 0 or k_in == 0:
        return None, "empty input"
    # the kernel takes x, the residual and its output with their leading dims as they are
    fn, why = make_kernel(maker, w, bias, rows, epilogue=m.params["epilogue"],
                          residual=res is not None, dtype=xm.dtype, lead=tuple(lead), **extra)
    if fn is None:
        return None, why
    if res is None or tuple(metas[res].shape) == out_shape:
        return fn, None
    return (lambda x, r: fn(x, r.reshape(out_shape))), None


def _linear_topk(m: Match, metas, consts):
    xm: TensorMeta = metas[m.inputs["x"]]
    w, source = _weight(m, consts), consts[m.inputs["weight"]]
    n_out, k_in = w.shape
    k = m.params["k"]
    if xm.shape[-1] != k_in or not 0 < k <= n_out:
        return None, f"topk k={k} of {n_out} scores"
    lead = xm.shape[:-1]
    wrap = torch.return_types.topk
    if not known(*lead):
        fn, why = make_kernel("make_linear_topk", w, None, k, largest=m.params["largest"],
                              dtype=xm.dtype, source=source)
        if fn is None:
            return None, why
        if _hot_single_row():
            fn = _single_row_first(fn, make_kernel("make_linear_topk", w, 1, k,
                                                   largest=m.params["largest"], dtype=xm.dtype,
                                                   source=source)[0])

        if len(lead) == 1:  # no reshape or views: each costs 1-2 us, the kernel 23 at one row
            return mark_generic(lambda x: wrap(fn(x)), True), None

        def run_generic(x):
            v, i = fn(x.reshape(-1, k_in))
            shape = (*x.shape[:-1], k)
            return wrap((v.view(shape), i.view(shape)))
        return mark_generic(run_generic, True), None
    rows = _prod(lead)
    if rows == 0:
        return None, "empty input"
    fn, why = make_kernel("make_linear_topk", w, rows, k, largest=m.params["largest"],
                          dtype=xm.dtype, source=source)
    if fn is None:
        return None, why
    if len(lead) == 1:
        return (lambda x: wrap(fn(x))), None
    shape2, out_shape = (rows, k_in), (*lead, k)

    def run(x):
        v, i = fn(x.reshape(shape2))
        return wrap((v.view(out_shape), i.view(out_shape)))
    return run, None


def _hot_single_row() -> bool:
    """Whether a fused top-k generic over rows also gets one specialised to a single row: in
    packages, for batch-1 serving (one row screens with int8 weights and rescores only what can
    still win: 36 -> 23 us for the tutorial Ranker). Linears do not: their generic kernel is as
    fast at one row, and faster than a single-row one when memory bandwidth is scarce."""
    return getattr(_specialising, "on", False)


def _single_row_first(fn, one):
    """``fn`` over 2-D inputs, calling ``one`` (built for a single row) when there is one."""
    if one is None:
        return fn

    def run(x, *rest):
        return one(x, *rest) if x.shape[0] == 1 else fn(x, *rest)
    return mark_generic(run, True)


def _transposed_contiguous(meta: TensorMeta) -> bool:
    """Whether the tensor is ``c.transpose(-1, -2)`` of a contiguous ``c`` (e.g. ``k.mT``)."""
    if len(meta.shape) < 2:
        return False
    shape = (*meta.shape[:-2], meta.shape[-1], meta.shape[-2])
    stride = (*meta.stride[:-2], meta.stride[-1], meta.stride[-2])
    return same_layout(shape, stride, contiguous_strides(shape))


def transposed_view(meta: TensorMeta) -> bool:
    """Whether a matmul's b is read as ``c.mT`` of a contiguous ``c`` rather than copied: the
    metadata's judgement of what ``custom_ops.transposed_view`` judges on the real tensor
    (False where symbolic strides leave it open)."""
    try:
        return not meta.contiguous and _transposed_contiguous(meta)
    except TypeError:
        return False


def _matmul(m: Match, metas, consts):
    am, bm = metas[m.inputs["a"]], metas[m.inputs["b"]]
    (mm, ka), (kb, nn) = am.shape[-2:], bm.shape[-2:]
    if not known(ka, kb, nn):
        return None, "the inner size or the columns vary at run time (they shape the kernel)"
    if ka != kb:
        return None, "inner sizes differ"
    if not known(*am.shape, *bm.shape):
        return _matmul_generic(am, bm, ka, nn, m.params.get("b_transposed"))
    if len(bm.shape) == 2:       # (..., m, k) @ (k, n): fold the batch into m
        rows = _prod(am.shape[:-1])
        batch, a_shape, c_rows = 1, (1, rows, ka), rows
        out_shape = (*am.shape[:-1], nn)
    else:
        if am.shape[:-2] != bm.shape[:-2]:
            return None, "broadcast batch dimensions"
        batch = _prod(am.shape[:-2])
        a_shape, c_rows = (batch, mm, ka), mm
        out_shape = (*am.shape[:-2], mm, nn)
    if 0 in (batch, c_rows, ka, nn):
        return None, "empty input"
    # b = c.mT with c contiguous (q @ k.mT): read c as is instead of copying b
    bt = transposed_view(bm)
    b_shape = (batch, nn, kb) if bt else (batch, kb, nn)
    fn, why = make_kernel("make_matmul", c_rows, ka, nn, batch=batch, b_transposed=bt,
                          dtype=am.dtype)
    if fn is None:
        return None, why
    if bt:
        return (lambda a, b: fn(a.reshape(a_shape), b.mT.reshape(b_shape)).view(out_shape)), None
    if tuple(am.shape) == a_shape and tuple(bm.shape) == b_shape and out_shape == (
            batch, mm, nn):  # a bmm: the kernel takes the tensors as they are (two fewer calls)
        return fn, None
    return (lambda a, b: fn(a.reshape(a_shape), b.reshape(b_shape)).view(out_shape)), None


def _matmul_generic(am, bm, k: int, n: int, bt: bool | None):
    """A matmul whose rows or batch vary: one kernel generic over both. ``bt``: b is ``c.mT``
    of a contiguous ``c`` (read as is); None: judged from b's metadata."""
    if len(bm.shape) > 2 and len(am.shape) != len(bm.shape):
        return None, "broadcast batch dimensions"
    if bt is None:
        bt = transposed_view(bm)
    fn, why = make_kernel("make_matmul", None, k, n, batch=None, b_transposed=bt, dtype=am.dtype)
    if fn is None:
        return None, why
    if len(bm.shape) == 2:     # (..., m, k) @ (k, n): the batch folds into the rows
        def run(a, b):
            return fn(a.reshape(1, -1, k), b.mT[None] if bt else b[None]) \
                .view(*a.shape[:-1], n)
    else:
        def run(a, b):
            if a.shape[:-2] != b.shape[:-2]:
                return torch.matmul(a, b)  # a broadcast batch: ATen's, as the graph meant
            c = fn(a.reshape(-1, *a.shape[-2:]),
                   b.mT.reshape(-1, n, k) if bt else b.reshape(-1, k, n))
            return c.view(*a.shape[:-1], n)
    return mark_generic(run, True), None


# Above this many elements ATen's own vectorised erf makes a standalone erf GELU faster than
# Kwker's (0.8-0.95x measured on a 2-core Zen 4); fused into a GEMM epilogue it still pays.
GELU_ERF_MAX = 65536
GELU_ERF_MAX_BF16 = 16384  # bf16: 1.25x at 16384, 0.84x at 65536 (the conversions add up)


def _gelu(m: Match, metas, consts):
    xm: TensorMeta = metas[m.inputs["x"]]
    approximate = m.params["approximate"]
    limit = GELU_ERF_MAX if xm.dtype == torch.float32 else GELU_ERF_MAX_BF16
    if not known(*xm.shape):
        fn, why = make_kernel("make_gelu", None, approximate=approximate, dtype=xm.dtype)
        if fn is None:
            return None, why
        erf = approximate == "none"
        gelu = torch.nn.functional.gelu

        def run(x):  # ATen's where it is faster or the layout is not the kernel's
            if (erf and x.numel() > limit) or not x.is_contiguous():
                return gelu(x, approximate=approximate)
            return fn(x)
        return mark_generic(run, True), None
    if not xm.contiguous or xm.numel == 0:
        return None, "non-contiguous or empty input"
    if approximate == "none" and xm.numel > limit:
        return None, f"erf GELU of {xm.numel} elements: ATen's is faster above {limit}"
    return make_kernel("make_gelu", xm.numel, approximate=approximate, dtype=xm.dtype)


def _dense(meta: TensorMeta) -> bool:
    try:
        return bool(meta.contiguous)
    except TypeError:   # symbolic strides that do not compare
        return False


def _silu_mul(m: Match, metas, consts):
    xm: TensorMeta = metas[m.inputs["x"]]
    ym: TensorMeta = metas[m.inputs["y"]]
    silu = torch.nn.functional.silu
    if not (_dense(xm) and _dense(ym)):
        # rows a stride apart (the two halves of a fused gate/up projection's chunk): the
        # row kernel, one for every size (inputs that are not rows of a stride go to ATen)
        fn, why = make_kernel("make_silu_mul_rows", dtype=xm.dtype)
        return (mark_generic(fn, True), None) if fn is not None else (None, why)
    if not known(*xm.shape):
        fn, why = make_kernel("make_silu_mul", None, dtype=xm.dtype)
        if fn is None:
            return None, why

        def run(x, y):  # strided inputs: ATen's, which reads any layout
            if x.is_contiguous() and y.is_contiguous():
                return fn(x, y)
            return silu(x) * y
        run.native = getattr(fn, "native", None)   # contiguous inputs, as the chain's are
        return mark_generic(run, True), None
    if xm.numel == 0:
        return None, "empty input"
    return make_kernel("make_silu_mul", xm.numel, dtype=xm.dtype,
                       width=xm.shape[-1] if xm.shape else None)


def norm_aten(norm: str, d: int, w, b, eps: float, out_dtype=None):
    """``callable(x)``: the normalisation as ATen (or, for ``rms_hf``, transformers) computes
    it, for inputs a kernel does not take; ``out_dtype``: then cast to it (autocast's cast the
    kernel fuses)."""
    F = torch.nn.functional
    if norm == "layer":
        def fn(x):
            return F.layer_norm(x, (d,), w, b, eps)
    elif norm == "rms":
        def fn(x):
            if w is None or w.dtype == x.dtype:
                return F.rms_norm(x, (d,), w, eps)
            h = x.float()   # a float32 weight of a bf16 x (Gemma's 1 + w): one rounding
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)
    else:
        def fn(x):
            h = x.float()
            y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
            return y if w is None else w.to(x.dtype) * y
    return fn if out_dtype is None else (lambda x: fn(x).to(out_dtype))


def offset_weight(w, offset: float):
    """A norm's weight as its kernel and ATen fallback read it: Gemma's ``1 + w`` is added in
    float32 (``offset`` 1.0), any other weight is as it is."""
    return w.float() + offset if offset and w is not None else w


def _layer_norm(m: Match, metas, consts):
    xm: TensorMeta = metas[m.inputs["x"]]
    d, eps, norm = m.params["d"], m.params["eps"], m.params.get("norm", "layer")
    if pinned(xm.shape[-1], True) != d:
        return None, f"normalised over {d} features, the input has {xm.shape[-1]}"
    w, b = (consts[m.inputs[k]].detach() if m.inputs[k] is not None else None
            for k in ("weight", "bias"))
    w = offset_weight(w, m.params.get("offset", 0.0))
    lead, out = xm.shape[:-1], m.params.get("out")   # out: bf16, autocast's cast fused
    if not known(*lead):
        fn, why = make_kernel("make_layer_norm", d, w, b, eps, None, dtype=xm.dtype, norm=norm,
                              out_dtype=out)
        if fn is None:
            return None, why
        aten = norm_aten(norm, d, w, b, eps, out)

        def run(x):  # a strided input: ATen's, which reads any layout
            return fn(x) if x.is_contiguous() else aten(x)
        return mark_generic(run, True), None
    if not xm.contiguous or xm.numel == 0:
        return None, "non-contiguous or empty input"
    return make_kernel("make_layer_norm", d, w, b, eps, _prod(lead), dtype=xm.dtype, norm=norm,
                       out_dtype=out)


def _sorting(m: Match, metas, consts):
    mod = S.module()
    if mod is None:
        return None, "kwker.ops.sorting is not available on this torch"
    v, args = m.params["variant"], m.params["args"]
    wrap = S.RETURN_TYPES.get(v)
    run = S.run
    if any(isinstance(a, Node) for a in args):  # quantile's q tensor: read at run time
        q_at = next(i for i, a in enumerate(args) if isinstance(a, Node))
        head, tail = args[:q_at], args[q_at + 1:]
        return (lambda x, q: run(mod, v, x, *head, q, *tail)), None
    if wrap is None:
        return (lambda x: run(mod, v, x, *args)), None
    return (lambda x: wrap(run(mod, v, x, *args))), None


def _grouped_mm(m: Match, metas, consts):
    """One kernel generic over the rows for every expert (kernels/grouped.py): the runs'
    lengths change with each call's routing."""
    xm = metas[m.inputs["x"]]
    source = consts[m.inputs["weight"]]
    w = expert_weights(source, m.inputs["transposed"])
    if xm.shape[-1] != w.shape[2] or metas[m.inputs["offs"]].shape[0] != w.shape[0]:
        return None, f"x {xm.shape} and offsets against {w.shape[0]} experts of {w.shape[2]}"
    fn, why = make_kernel("make_grouped_linear", w, dtype=xm.dtype, source=source)
    return mark_generic(fn, True), why   # whatever the graph's sizes, it serves every row count


def _rope(m: Match, metas, consts):
    """One kernel per row length and dtype: sizes, strides and broadcasting are read per call
    (and a layout it does not take runs the ATen composition), so it serves every size."""
    x_dtype, dtype = metas[m.inputs["x"]].dtype, metas[m.inputs["cos"]].dtype
    fn, why = make_kernel("make_rope", m.params["d"], dtype=dtype, x_dtype=x_dtype)
    return mark_generic(fn, True), why


_BUILDERS = {"linear": _linear, "linear_topk": _linear_topk, "matmul": _matmul, "gelu": _gelu,
             "sdpa": build_sdpa, "layer_norm": _layer_norm, "silu_mul": _silu_mul, "rope": _rope,
             "grouped_mm": _grouped_mm, "sorting": _sorting}


def restrided(fn, meta: TensorMeta):
    """``fn`` whose tensor result is copied into ``meta``'s strides if ATen's layout differs
    (a kernel that already writes that layout is left alone)."""
    if same_layout(meta.shape, meta.stride, contiguous_strides(meta.shape)):
        return fn
    shape, stride = meta.shape, tuple(meta.stride)

    def run(*args):
        out = fn(*args)
        if out.stride() == stride:
            return out
        return torch.empty_strided(shape, stride, dtype=out.dtype).copy_(out)
    return run
