"""``make_kv_append``: ``torch.cat([past, new], dim)`` for a KV cache, written in place.

A decoder's cache grows by a token per step, and ``cat`` copies the whole past each time: on a
GPT-2-sized model 24 copies of up to a few hundred KB per token, 10% of a low-bit decode step.
This append returns the same values as ``cat`` as a view into a buffer with spare room along
``dim``. When the next step hands that view back as ``past``, the new rows are written after it
and a longer view of the same buffer is returned: no copy of the past.

Why it is safe. The buffer's storage records how many rows along ``dim`` have been handed out
(``committed``). Rows are only ever written beyond every view given out so far, so no tensor a
caller holds ever changes. In place is taken only when ``past`` is exactly the buffer's first
``committed`` rows (same storage, offset 0, the buffer's strides, the other sizes equal) and the
new rows fit. Anything else copies into a new buffer, as ``cat`` would: a cache cropped or
reordered by the caller, an older view appended to a second time (beam search, a re-run
step), tensors that need grad, dtypes that differ, a buffer made in inference mode used
outside it. The state sits on the storage object (torch keeps one Python object per storage),
so it lives and dies with the buffer.

The views have strides of the buffer's capacity, not contiguous ones; only consumers that read
any strides (ATen, Kwker's attention kernels) may be given them (see lowering/kv_append.py).

``make_append_attend``: a layer's two appends and the attention over their results as one step,
under the same rules: the new rows written by a small copy kernel (codegen/row_copy.py), or, for
a Llama's rotated keys, by the rope kernel that rotates them (and q), and the attention, called
in turn by one native function (attend_call.py).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._call import _profiler_enabled
from .attend_call import OneCall
from .rope import broadcast_strides
from .specs import RowCopySpec

# the attribute on a buffer's UntypedStorage: [the shape of the latest view handed out (its rows
# along dim are the rows committed), the buffer's strides, its rows along dim, dim, the shape a
# one-row ``new`` must have]
STATE = "_kwker_kv"
MIN_ROWS = 64
SCRATCH_MAX = 64 << 10   # bytes of a rotated q kept per thread between calls


def capacity(rows: int) -> int:
    """Rows a new buffer holds for ``rows`` rows: the power of two at least 1.5x, so a cache is
    copied O(log length) times and its strides take few values (each new one may cost dynamo a
    recompile until it makes them symbolic)."""
    return max(MIN_ROWS, 1 << (rows + rows // 2 - 1).bit_length())


def make_kv_append(dim: int):
    """``append(past, new)`` = ``torch.cat([past, new], dim)`` (``dim`` >= 0), in place where
    ``past`` is the latest view this kind of append handed out (see the module docstring)."""
    cat, inference_mode = torch.cat, torch.is_inference_mode_enabled
    as_strided = torch.Tensor.as_strided

    def fresh(past, new):
        if past.dim() == 1 and past.numel() == 0:  # an empty start, which cat skips
            parts = [new]
        else:
            parts = [past, new]
        if past.dtype != new.dtype or past.dim() != new.dim() and len(parts) == 2 or \
                new.dim() <= dim or past.requires_grad or new.requires_grad:
            return cat([past, new], dim)  # promotion, errors and autograd as ATen has them
        rows = sum(p.shape[dim] for p in parts)
        shape = list(parts[0].shape)
        shape[dim] = capacity(rows)
        buf = new.new_empty(shape)
        out = buf.narrow(dim, 0, rows)
        cat(parts, dim, out=out)  # ATen's shape checks and messages
        size = tuple(out.shape)
        setattr(buf.untyped_storage(), STATE,
                [size, buf.stride(), shape[dim], dim, size[:dim] + (1,) + size[dim + 1:]])
        return out

    def append(past, new):
        state = getattr(past.untyped_storage(), STATE, None)
        if state is None or state[3] != dim:  # not a buffer, or one grown along another dim
            return fresh(past, new)
        # the latest view's shape, the buffer's strides, its rows, _, a one-row new's shape
        shape, stride, rows_max, _, one = state
        rows, ns = shape[dim], new.shape
        if ns == one:   # a decode step's row: its other sizes are the past's
            n = 1
        elif len(ns) == len(shape) and ns[:dim] == shape[:dim] and \
                ns[dim + 1:] == shape[dim + 1:]:
            n = ns[dim]
        else:
            return fresh(past, new)
        if rows + n > rows_max or past.shape != shape or past.stride() != stride or \
                past.storage_offset() or past.dtype != new.dtype or past.requires_grad or \
                new.requires_grad or (past.is_inference() and not inference_mode()):
            return fresh(past, new)
        size = shape[:dim] + (rows + n,) + shape[dim + 1:]
        as_strided(past, ns, stride, rows * stride[dim]).copy_(new)
        state[0] = size
        return as_strided(past, size, stride)

    return append


@dataclass(frozen=True)
class FixedView:
    """A view worked out when the program was built: ``size`` and ``stride`` at ``offset``
    elements into a root tensor of ``root_shape`` and ``root_stride`` (checked per call).
    ``make(root)`` builds it as a tensor, for the calls not read in place (lowering/views.py:
    by one ``as_strided`` where the root's layout allows, else by the ops that made it)."""
    root_shape: tuple
    root_stride: tuple
    size: tuple
    stride: tuple
    offset: int
    make: Callable


def make_append_attend(attend, views: tuple, out_shape: tuple, out_stride: tuple,
                       result: FixedView | None = None, rope: tuple | None = None,
                       deferred: bool = False):
    """``step(q, past_k, new_k, past_v, new_v) -> (out, keys, values)``: what
    ``keys = append(past_k, new_k); values = append(past_v, new_v); out = attend(q, keys,
    values)`` gives with two ``make_kv_append(2)`` appends along the rows of (B, H, T, D) caches
    and ``attend`` a generic attention kernel without a mask (kernels/sdpa.py), in one step.

    A decoder's layer runs these three steps back to back, and with the caches cold after the
    weights' stream each torch call among them costs several times its warm price: this step
    writes the new rows into both buffers and attends over them in one native call
    (attend_call.py), reading q and the new rows, views of the q/k/v projection, in place
    (``views``: for q, new_k, new_v, a ``FixedView`` where the step is given the view's root,
    else None). ``out_shape`` and ``out_stride``: the attention output's, as the graph recorded
    it. Any call the in-place path does not take (see ``make_kv_append``), or of other sizes,
    runs the three steps as written: the same values. ``result``: the view of attention's
    output the step gives instead, contiguous from its first element over exactly its memory
    (allocated as that view, written through the output's strides).

    ``rope``: ``(rotate, cos view, sin view)`` where q and new_k are rotated first
    (``rotate``: a ``make_rope`` callable of the attention's dtype; views as above): the step is
    ``step(q, past_k, new_k, past_v, new_v, cos, sin)`` with q and new_k before the rotation,
    which writes the rotated keys straight into the cache's buffer and q into a scratch (a Llama
    layer's two rope steps, and the views of cos and sin they read, are then inside this one).

    ``deferred``: the keys and values it grew in place are given as ``(buffer view, size,
    stride)``, made views by the program when it builds its output (lowering/runner.py's
    ``KernelStep.deferred``, only where nothing else reads them): their two ``as_strided`` then
    run back to back with the other layers', warm, not between two weight streams (GPT-2 int4
    packaged, Xeon with AMX, in one process: 11 us a layer less)."""
    if any(v is not None and (len(v.size) != 4 or v.stride[3] != 1) for v in views):
        raise ValueError(f"make_append_attend: views must be 4-D with rows contiguous: {views}")
    heads, kvh, e, ev, dtype = attend.dims
    size = torch.empty((), dtype=dtype).element_size()
    spec_k, spec_v = RowCopySpec(e * size), RowCopySpec(ev * size)
    append_k, append_v = make_kv_append(2), make_kv_append(2)
    as_strided, empty_strided, empty = torch.Tensor.as_strided, torch.empty_strided, torch.empty
    inference_mode = torch.is_inference_mode_enabled
    plain = (torch.Tensor, torch.nn.Parameter)
    b, _, lq, _ = out_shape
    qv, kv, vv = views
    rotate, cos_view, sin_view = rope or (None, None, None)
    threads = torch.get_num_threads
    # in place, the copies or rotations and the attention in one native call (attend_call.py);
    # under the profiler, the three steps as written, each kernel named in the trace
    one_call = OneCall(rotate.spec if rotate is not None else None, spec_k, spec_v, attend.spec,
                       size, b, lq)

    # the rotated q, read only inside the native call: one buffer per thread where it is small
    # (a decode step's; a fresh torch.empty cost ~10 us a layer there, with the caches cold)
    mine, small = threading.local(), b * heads * lq * e * size <= SCRATCH_MAX

    def rotated_q(shape):
        if not small:
            return empty(shape, dtype=dtype)
        buf = getattr(mine, "q", None)
        if buf is None:
            buf = mine.q = empty(shape, dtype=dtype)
        return buf

    def tensor(x, view):
        return x if view is None else view.make(x)

    def operand(x, view):
        """(data pointer, shape, strides) of an operand read in place, or None."""
        if type(x) not in plain or x.dtype is not dtype or x.requires_grad:
            return None
        if view is None:
            st = x.stride()
            return (x.data_ptr(), x.shape, st) if x.dim() == 4 and st[3] == 1 else None
        if x.shape != view.root_shape or x.stride() != view.root_stride:
            return None
        return x.data_ptr() + view.offset * size, view.size, view.stride

    # q, k and v views of one root (a q/k/v projection's row): its checks made once
    shared = None not in views and len({(v.root_shape, v.root_stride) for v in views}) == 1

    def operands(q, new_k, new_v):
        """The three operands as ``operand`` gives them."""
        qo = operand(q, qv)
        if not (shared and new_k is q and new_v is q):
            return qo, operand(new_k, kv), operand(new_v, vv)
        if qo is None:
            return None, None, None
        root = qo[0] - qv.offset * size
        return qo, (root + kv.offset * size, kv.size, kv.stride), \
            (root + vv.offset * size, vv.size, vv.stride)

    def grow(past, new, heads_in, d):
        """(the buffer's state, its rows so far, the grown view's size) where ``past`` takes
        the rows of ``new`` (an operand) in place, else None."""
        state = getattr(past.untyped_storage(), STATE, None)
        if state is None or state[3] != 2 or new is None:
            return None
        shape, stride, rows_max, _, one = state
        ns = new[1]
        n = 1 if ns == one else ns[2] if len(ns) == 4 and ns[:2] == shape[:2] and \
            ns[3] == shape[3] else 0
        rows = shape[2]
        if not n or rows + n > rows_max or past.shape != shape or past.stride() != stride or \
                past.storage_offset() or past.dtype is not dtype or past.requires_grad or \
                (past.is_inference() and not inference_mode()) or shape[0] != b or \
                shape[1] != heads_in or shape[3] != d:
            return None
        return state, rows, (shape[0], shape[1], rows + n, shape[3])

    def rope_table(cos, sin, q_shape, k_shape):
        """(cos's and sin's addresses, their strides over q's and over the new keys' (B, H,
        T)), read in place, or None."""
        co, so = operand(cos, cos_view), operand(sin, sin_view)
        if co is None or so is None or tuple(co[1]) != tuple(so[1]) or \
                tuple(co[2]) != tuple(so[2]):
            return None
        over_q = broadcast_strides(co[1], co[2], q_shape)
        over_k = broadcast_strides(co[1], co[2], k_shape)
        return None if over_q is None or over_k is None else (co[0], so[0], over_q, over_k)

    def step(q, past_k, new_k, past_v, new_v, cos=None, sin=None):
        qo, ko, vo = operands(q, new_k, new_v)
        gk, gv = grow(past_k, ko, kvh, e), grow(past_v, vo, kvh, ev)
        rot = rope_table(cos, sin, qo[1], ko[1]) if rotate is not None and qo is not None \
            and ko is not None else None
        if qo is None or gk is None or gv is None or gk[2][2] != gv[2][2] or \
                tuple(qo[1]) != (b, heads, lq, e) or qo[2][3] != 1 or \
                rotate is not None and rot is None or _profiler_enabled():
            q, new_k = tensor(q, qv), tensor(new_k, kv)
            if rotate is not None:
                cos, sin = tensor(cos, cos_view), tensor(sin, sin_view)
                q, new_k = rotate(q, cos, sin), rotate(new_k, cos, sin)
            keys = append_k(past_k, new_k)
            values = append_v(past_v, tensor(new_v, vv))
            return tensor(attend(q, keys, values), result), keys, values
        (sk, rk, size_k), (sv, rv, size_v) = gk, gv
        rq = None if rot is None else rotated_q(qo[1])
        out = empty_strided(out_shape, out_stride, dtype=dtype) if result is None else \
            empty_strided(result.size, result.stride, dtype=dtype)
        layout = ((qo[1], qo[2]), rq.stride() if rq is not None else None, (ko[1], ko[2]),
                  (vo[1], vo[2]), out_stride, sk[1], sv[1],
                  *((rot[2], rot[3]) if rot is not None else (None, None)))
        pk, pv = past_k.data_ptr(), past_v.data_ptr()
        rope_ptrs = (rot[0], rot[1], rq.data_ptr()) if rot is not None else (None,) * 3
        one_call(layout, (qo[0], *rope_ptrs, ko[0], pk + rk * sk[1][2] * size, vo[0],
                          pv + rv * sv[1][2] * size, pk, pv, out.data_ptr()), size_k[2],
                 threads())
        sk[0], sv[0] = size_k, size_v
        if deferred:
            return out, (past_k, size_k, sk[1]), (past_v, size_v, sv[1])
        return out, as_strided(past_k, size_k, sk[1]), as_strided(past_v, size_v, sv[1])

    step.specs = list(dict.fromkeys((spec_k, spec_v))) + [attend.spec] + \
        ([rotate.spec] if rotate is not None else [])
    return step
