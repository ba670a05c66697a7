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
"""
from __future__ import annotations

import torch

# the attribute on a buffer's UntypedStorage: [the shape of the latest view handed out (its rows
# along dim are the rows committed), the buffer's strides, its rows along dim, dim, the shape a
# one-row ``new`` must have]
STATE = "_kwker_kv"
MIN_ROWS = 64


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
