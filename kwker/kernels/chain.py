"""``make_chain``: kernels run one after another by one native call (codegen/chain.py).

A decode step runs ~50 linears and ~25 norms, each a few microseconds of Python around its
kernel (the step's frame, the output's ``torch.empty``, the ctypes call). After the weights'
stream (124 MB a token for GPT-2 int8) every one of them runs with cold caches, and the gap
also slows the next kernel's first reads. Between two attentions a decoder layer's kernels
(projection, norm, MLP, norm, the next q/k/v projection) only read each other's rows: one call
makes them all, the rows no one else reads living in one scratch buffer.

A member is a factory callable with a ``native`` form (``_call.Native``). The chain's call
checks its outside inputs as each member's own common call would (shape, dtype, contiguity, no
profiler) and otherwise calls the members in Python, so every call gets the members' answer
(under the profiler inside a ``record_function`` of the chain's symbol, each member naming
itself within it).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..codegen.chain import ALIGN
from ._call import Native, _profiler_enabled, entry, record_function
from .specs import ChainSpec


@dataclass(frozen=True)
class Member:
    """One kernel of a chain: its callable, how the chain makes its call, where each tensor
    argument comes from (``("ext", j)`` the chain's argument j, ``("mid", i)`` member i's
    output) and whether anything outside the chain reads its output (the last's always is)."""
    fn: Callable
    native: Native
    inputs: tuple
    escapes: bool


def make_chain(members: list[Member]):
    """``run(*ext)``: the members' outputs as calling them in turn gives them, the last member's
    output first and then each other escaping one's (a tuple when there are several)."""
    if len(members) < 2:
        raise ValueError(f"make_chain: a chain has at least two kernels, got {len(members)}")
    members = [m if i < len(members) - 1 else Member(m.fn, m.native, m.inputs, True)
               for i, m in enumerate(members)]
    members = _widths_resolved(members)
    n_ext = 1 + max((j for m in members for kind, j in m.inputs if kind == "ext"), default=-1)
    ext_kind: dict[int, tuple] = {}     # ext j -> (width, dtype), from its first reader
    for i, m in enumerate(members):
        for (kind, j), width, dtype in zip(m.inputs, m.native.widths, m.native.dtypes):
            if kind == "mid" and not 0 <= j < i:
                raise ValueError(f"make_chain: member {i} reads member {j}'s output")
            if kind == "ext":
                seen = ext_kind.setdefault(j, (width, dtype))
                if seen != (width, dtype):
                    raise ValueError(f"make_chain: argument {j} read as {seen} and as "
                                     f"{(width, dtype)}")
            elif (members[j].native.n, members[j].native.out_dtype) != (width, dtype):
                raise ValueError(f"make_chain: member {j}'s output is not what its reader takes")
    if sorted(ext_kind) != list(range(n_ext)):
        raise ValueError("make_chain: every argument of the chain must be read")
    escaping = [i for i, m in enumerate(members) if m.escapes]
    words, scratch, out_token = [], [], []
    for i, m in enumerate(members):
        if m.escapes:
            out_token.append(f"t{n_ext + escaping.index(i)}")
        else:
            out_token.append(f"s{len(scratch)}")
            scratch.append(m.native.n * torch.empty((), dtype=m.native.out_dtype).element_size())
    calls = []
    for i, m in enumerate(members):
        tokens = [_word(words, m.native.addr)]
        for w in m.native.words:
            kind = w[0]
            if kind == "in":
                src, j = m.inputs[w[1]]
                tokens.append(f"t{j}" if src == "ext" else out_token[j])
            elif kind == "out":
                tokens.append(out_token[i])
            elif kind == "word":
                tokens.append("z" if w[1] is None else _word(words, w[1]))
            elif kind == "numel":
                tokens.append(f"e{m.native.n}")
            elif kind == "width":
                tokens.append(_word(words, m.native.widths[0]))
            else:
                tokens.append({"rows": "r", "threads": "n"}[kind])
        calls.append(" ".join(tokens))
    spec = ChainSpec(tuple(calls), tuple(scratch), n_ext + len(escaping))
    table = torch.tensor(words, dtype=torch.int64)
    return _run(spec, table, members, escaping, [ext_kind[j] for j in range(n_ext)])


def _widths_resolved(members: list[Member]) -> list[Member]:
    """The members with every width of 0 (any, ``Native``) made the width its producer gives."""
    out: list[Member] = []
    for i, m in enumerate(members):
        widths = []
        for (kind, j), width in zip(m.inputs, m.native.widths):
            if width == 0:
                if kind != "mid" or not 0 <= j < i:
                    raise ValueError(f"make_chain: member {i} takes rows of any width, which only "
                                     "an earlier member's output gives")
                width = out[j].native.n
            widths.append(width)
        native = replace(m.native, widths=tuple(widths), n=m.native.n or widths[0])
        out.append(replace(m, native=native))
    return out


def _word(words: list, value: int) -> str:
    words.append(int(value))
    return f"w{len(words) - 1}"


def _rows_check(members: list[Member]) -> Callable[[tuple, int], bool]:
    """``ok(lead, rows)``: whether every member's common call takes these leading dims, as one
    comparison (a chain's call makes it every time)."""
    natives = [m.native for m in members]
    leads = {n.lead for n in natives if n.lead is not None}
    fixed = {n.rows for n in natives if n.lead is None and n.rows}
    if len(leads) > 1 or len(fixed) > 1:
        raise ValueError(f"make_chain: members built for different rows ({leads or fixed})")
    if leads:
        (lead,) = leads
        if not all(n.accepts(lead, math.prod(lead)) for n in natives):
            raise ValueError(f"make_chain: not every member takes leading dims {lead}")
        return lambda got, rows: got == lead
    most = min((n.max_rows for n in natives if not n.rows), default=0)
    if fixed:
        (count,) = fixed
        if most and count > most:
            raise ValueError(f"make_chain: {count} rows is more than a member takes ({most})")
        return lambda got, rows: rows == count
    return lambda got, rows: 0 < rows <= most


def _returned(outs: list):
    """The escaping outputs, in member order, as the chain gives them: the last member's, then
    the others'."""
    return outs[0] if len(outs) == 1 else (outs[-1], *outs[:-1])


def _run(spec: ChainSpec, table: torch.Tensor, members: list[Member], escaping: list[int],
         ext: list[tuple]):
    fn = entry(spec, 2 + spec.tensors, 2)
    words = table.data_ptr()
    # the last member escapes and comes last in ``escaping``: it is returned first
    outs = [(members[i].native.n, members[i].native.out_dtype) for i in escaping]
    ok_rows = _rows_check(members)
    width0 = ext[0][0]
    empty, threads = torch.empty, torch.get_num_threads

    def scratch_bytes(rows: int) -> int:   # as codegen/chain.py lays the buffers out
        return sum(-(-rows * b // ALIGN) * ALIGN for b in spec.scratch)

    def fallback(*args):
        values = []
        for m in members:
            values.append(m.fn(*[args[j] if kind == "ext" else values[j]
                                 for kind, j in m.inputs]))
        return _returned([values[i] for i in escaping])

    def run(*args):
        x = args[0]
        lead = x.shape[:-1]
        rows = x.numel() // width0
        if _profiler_enabled():   # each kernel named in the trace, inside the chain's name
            with record_function(spec.symbol):
                return fallback(*args)
        if not ok_rows(lead, rows):
            return fallback(*args)
        for t, (width, dtype) in zip(args, ext):
            if not (t.dim() and t.shape[-1] == width and t.shape[:-1] == lead and
                    t.dtype == dtype and t.is_contiguous()):
                return fallback(*args)
        made = [empty((*lead, n), dtype=dtype) for n, dtype in outs]
        buf = empty(scratch_bytes(rows), dtype=torch.uint8) if spec.scratch else None
        fn(words, None if buf is None else buf.data_ptr(), *[t.data_ptr() for t in args],
           *[t.data_ptr() for t in made], rows, threads())
        return _returned(made)

    run.spec, run.table, run.members, run.fallback = spec, table, members, fallback
    return run
