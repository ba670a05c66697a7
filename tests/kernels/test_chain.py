"""Chains (kernels/chain.py): kernels called from one native function give, bit for bit, what
calling each kernel's own callable in turn gives; any call a member's common path would not
take runs the members one by one."""
import pytest
import torch

from kwker.codegen import chain as chain_codegen
from kwker.kernels.chain import Member, make_chain
from kwker.kernels.eltwise import make_silu_mul, make_silu_mul_rows
from kwker.kernels.linear import make_linear
from kwker.kernels.norm import make_layer_norm
from kwker.runtime.kernel import ir_text
from kwker.runtime.target import host_target

D, H = 48, 80   # model width, MLP width


def block(dtype=torch.float32, lead=None, seed=0):
    """A decoder MLP's kernels: (norm, fc + gelu, proj + residual), fixed to ``lead`` or
    generic over rows (``lead=None``)."""
    torch.manual_seed(seed)
    m = None if lead is None else int(torch.tensor(lead).prod())
    ln_w, ln_b = torch.randn(D), torch.randn(D)
    w1, b1, w2, b2 = torch.randn(H, D) / 7, torch.randn(H), torch.randn(D, H) / 9, torch.randn(D)
    w1, b1, w2, b2 = (t.to(dtype) for t in (w1, b1, w2, b2))
    norm = make_layer_norm(D, ln_w, ln_b, 1e-5, rows=m, dtype=dtype)
    fc = make_linear(w1, b1, m=m, epilogue="gelu_tanh", dtype=dtype, lead=lead)
    proj = make_linear(w2, b2, m=m, residual=True, dtype=dtype, lead=lead)
    return norm, fc, proj


def mlp_chain(norm, fc, proj, escapes=(False, False)):
    """``chain(x) = proj(fc(norm(x)), x)``: x the chain's argument 0."""
    return make_chain([Member(norm, norm.native, (("ext", 0),), escapes[0]),
                       Member(fc, fc.native, (("mid", 0),), escapes[1]),
                       Member(proj, proj.native, (("mid", 1), ("ext", 0)), True)])


def by_members(norm, fc, proj, x):
    h = norm(x)
    a = fc(h)
    return proj(a, x), h, a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("lead", [(1, 1), (3,), None], ids=["token", "rows3", "generic"])
def test_chain_equals_members(dtype, lead):
    kernels = block(dtype, lead)
    chained = mlp_chain(*kernels)
    for rows in ((1, 2, 5, 16, 33) if lead is None else (None,)):
        shape = (*lead, D) if lead else (rows, D)
        x = torch.randn(shape).to(dtype)
        if x.numel() > D:   # a row of NaN, inf and -0.0 (then NaN throughout), carried as ATen does
            x.view(-1, D)[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0]).to(dtype)
        out = chained(x)
        want = by_members(*kernels, x)[0]
        assert out.shape == want.shape and out.dtype == want.dtype and out.is_contiguous()
        assert torch.equal(out.nan_to_num(), want.nan_to_num()), (dtype, lead, rows)
        assert torch.equal(out.isnan(), want.isnan())


def test_escaping_outputs_are_returned_after_the_last():
    """Members whose outputs are read outside the chain give them as tensors of their own (the
    others live in scratch); the last member's output comes first."""
    kernels = block(lead=(2,))
    x = torch.randn(2, D)
    out, h = mlp_chain(*kernels, escapes=(True, False))(x)
    want, want_h, _ = by_members(*kernels, x)
    assert torch.equal(out, want) and torch.equal(h, want_h)
    out, h, a = mlp_chain(*kernels, escapes=(True, True))(x)
    assert torch.equal(a, by_members(*kernels, x)[2])
    assert len({out.data_ptr(), h.data_ptr(), a.data_ptr()}) == 3


def test_other_calls_run_the_members():
    """A non-contiguous argument, another dtype, a row count the kernels do not take, and a
    call under the profiler: the members' own paths, with their answers and errors."""
    kernels = block(lead=None)
    chained = mlp_chain(*kernels)
    x = torch.randn(6, 2 * D)[:, ::2]
    assert torch.equal(chained(x), by_members(*kernels, x)[0])
    with pytest.raises((NotImplementedError, RuntimeError)):
        chained(torch.randn(3, D, dtype=torch.float64))
    with pytest.raises((ValueError, RuntimeError)):
        chained(torch.randn(3, D + 1))
    fixed = block(lead=(1, 1))
    x = torch.randn(1, 1, D)
    with torch.profiler.profile() as prof:
        out = mlp_chain(*fixed)(x)
    assert torch.equal(out, by_members(*fixed, x)[0])
    names = {e.name for e in prof.events()}
    assert any(n.startswith("kw_layernorm") for n in names), "members run under the profiler"
    with pytest.raises(ValueError):   # the fixed kernels' own check of the shape
        mlp_chain(*fixed)(torch.randn(1, 2, D))


def test_chain_reads_members_in_order_only():
    norm, fc, proj = block(lead=(1,))
    with pytest.raises(ValueError):
        make_chain([Member(fc, fc.native, (("mid", 1),), False),
                    Member(norm, norm.native, (("ext", 0),), True)])
    with pytest.raises(ValueError):   # fc's output is H wide, norm takes D
        make_chain([Member(fc, fc.native, (("ext", 0),), False),
                    Member(norm, norm.native, (("mid", 0),), True)])


def test_chain_ir_calls_each_entry_point_with_its_words():
    """One indirect call a member, its arguments the words the spec names: the table's, the
    tensors', scratch buffers at 64-byte aligned offsets, rows and threads."""
    chained = mlp_chain(*block(lead=None))
    spec = chained.spec
    assert len(spec.calls) == 3 and spec.tensors == 2 and len(spec.scratch) == 2
    text = ir_text(spec, host_target())
    assert text.count("call void %") == 3
    assert text.count("inttoptr") == 3 and "and i64 %" in text
    assert chain_codegen.ALIGN == 64
    # every layer of a model shares one chain kernel: addresses are data, not code
    assert mlp_chain(*block(lead=None, seed=1)).spec == spec


def test_swiglu_chain():
    """A Llama MLP's gate and up projections, SiLU times up, and the down projection with its
    residual: a member reading two others' outputs."""
    torch.manual_seed(2)
    lead = (1, 1)
    gate, up = (make_linear(torch.randn(H, D) / 7, None, m=1, lead=lead) for _ in range(2))
    down = make_linear(torch.randn(D, H) / 9, None, m=1, residual=True, lead=lead)
    act = make_silu_mul(H, width=H)
    chained = make_chain([Member(gate, gate.native, (("ext", 0),), False),
                          Member(up, up.native, (("ext", 0),), False),
                          Member(act, act.native, (("mid", 0), ("mid", 1)), False),
                          Member(down, down.native, (("mid", 2), ("ext", 1)), True)])
    x, res = torch.randn(1, 1, D), torch.randn(1, 1, D)
    assert torch.equal(chained(x, res), down(act(gate(x), up(x)), res))
    # the kernel for any size takes its rows' width from the members whose outputs it reads
    anywide = make_silu_mul(None)
    chained = make_chain([Member(gate, gate.native, (("ext", 0),), False),
                          Member(up, up.native, (("ext", 0),), False),
                          Member(anywide, anywide.native, (("mid", 0), ("mid", 1)), True)])
    assert torch.equal(chained(x), act(gate(x), up(x)))
    rows = make_silu_mul_rows()   # the rows kernel: its width a word of the chain's table
    chained = make_chain([Member(gate, gate.native, (("ext", 0),), False),
                          Member(up, up.native, (("ext", 0),), False),
                          Member(rows, rows.native, (("mid", 0), ("mid", 1)), False),
                          Member(down, down.native, (("mid", 2), ("ext", 1)), True)])
    assert torch.equal(chained(x, res), down(act(gate(x), up(x)), res))
    with pytest.raises(ValueError, match="any width"):
        make_chain([Member(anywide, anywide.native, (("ext", 0), ("ext", 1)), False),
                    Member(down, down.native, (("mid", 0), ("ext", 2)), True)])


def test_rows_a_chain_takes_are_those_every_member_takes():
    """A member fixed to (1, 1) rows and generic ones: the chain runs natively on (1, 1) only;
    members built for different rows do not make a chain."""
    fixed_norm = block(lead=(1, 1))[0]
    _, fc, proj = block(lead=None)
    chained = mlp_chain(fixed_norm, fc, proj)
    x = torch.randn(1, 1, D)
    assert torch.equal(chained(x), by_members(fixed_norm, fc, proj, x)[0])
    assert chained.spec.calls    # built, and the fixed norm's own check for other rows:
    with pytest.raises(ValueError):
        chained(torch.randn(1, 2, D))
    with pytest.raises(ValueError, match="make_chain: .*(rows|leading dims)"):
        mlp_chain(fixed_norm, *block(lead=(2,))[1:])
