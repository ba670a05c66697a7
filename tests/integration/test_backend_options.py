"""Registration, options, reports and logs, kernel dumps, profiler names, wider-ISA code."""
import dataclasses
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kwker.dynamo as kd
from kwker.kernels import blocking
from kwker.runtime import kernel
from kwker.runtime.compiler import compile_assembly
from kwker.runtime.target import host_target, make_target

from .models import assert_close, compile_run


class Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(24, 40)
        self.l2 = torch.nn.Linear(40, 8)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def test_entry_point_resolves_without_importing_kwker():
    code = textwrap.dedent("""
        import sys, torch
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()
        assert "kwker" not in sys.modules
        c = torch.compile(m, backend="kwker", options={"inner": "eager"})
        x = torch.randn(2, 8)
        with torch.no_grad():
            assert torch.allclose(c(x), m(x), rtol=1e-4, atol=1e-5)
        import kwker.dynamo
        print(kwker.dynamo.last_report().kernel_names)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "['linear_gelu']"


def test_inductor_is_imported_only_for_a_graph_left_to_it():
    """Default options: a model whose graph is all Kwker kernels runs as a flat program and never
    imports Inductor (~0.5-1 s of a warm compile); one with elementwise work left over does."""
    code = textwrap.dedent("""
        import sys, torch
        mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                  torch.nn.Linear(256, 32)).eval()
        x = torch.randn(16, 64)
        with torch.no_grad():
            assert torch.allclose(torch.compile(mlp, backend="kwker")(x), mlp(x), rtol=1e-4,
                                  atol=1e-5)
        print("flat", "torch._inductor.compile_fx" in sys.modules)
        left = lambda x: (mlp(x).sin() * 3).cos().exp() + x.sum()
        with torch.no_grad():
            assert torch.allclose(torch.compile(left, backend="kwker")(x), left(x), rtol=1e-4,
                                  atol=1e-5)
        print("left", "torch._inductor.compile_fx" in sys.modules)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["flat", "False", "left", "True"], out.stdout


def test_a_bad_inductor_mode_is_an_error_even_when_inductor_has_nothing_to_compile():
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU()).eval()
    torch._dynamo.reset()
    with pytest.raises(Exception, match="Unrecognized mode=bogus"), torch.no_grad():
        torch.compile(mlp, backend="kwker", mode="bogus")(torch.randn(4, 64))


def test_register_by_name_is_idempotent():
    from torch._dynamo.backends.registry import lookup_backend
    kd.register()
    kd.register()
    assert lookup_backend("kwker") is kd.backend


@pytest.mark.parametrize("options,needle", [
    ({"inner": "eager", "fast": True}, "'fast'"),
    ({"inner": "tvm"}, "'tvm'"),
])
def test_bad_options_are_explained(options, needle):
    torch._dynamo.reset()
    compiled = torch.compile(Two().eval(), backend="kwker", options=options)
    with pytest.raises(Exception) as info:
        compiled(torch.randn(3, 24))
    text = str(info.value)
    assert needle in text
    assert "inner" in text and ("dump_dir" in text or "'inductor', 'eager'" in text)


def test_default_inner_is_inductor():
    torch.manual_seed(0)
    torch._dynamo.reset()
    kd.clear_reports()
    model = Two().eval()
    x = torch.randn(3, 24)
    with torch.no_grad():
        assert_close(torch.compile(model, backend="kwker")(x), model(x))
    assert kd.last_report().inner == "inductor"
    assert kd.last_report().kernel_names == ["linear_relu", "linear"]


def test_report_and_log_line(caplog):
    torch.manual_seed(1)
    with caplog.at_level(logging.INFO, logger="kwker"):
        _, _, reports = compile_run(Two().eval(), (torch.randn(3, 24),), "eager")
    lines = [r.getMessage() for r in caplog.records if r.name == "kwker"]
    assert len(lines) == 1 and "2 Kwker kernels (linear_relu, linear)" in lines[0]
    report = reports[-1]
    assert len(report.kwker_nodes) == 3
    assert report.inner_nodes == [] and report.missed == []
    assert "linear_relu" in str(report)


def test_dump_dir_receives_ir_and_assembly(tmp_path):
    torch.manual_seed(2)
    torch._dynamo.reset()
    kd.clear_reports()
    model = Two().eval()
    compiled = torch.compile(model, backend="kwker",
                             options={"inner": "eager", "dump_dir": str(tmp_path)})
    with torch.no_grad():
        compiled(torch.randn(3, 24))
    specs = kd.last_report().specs
    # both linears, and the chain that calls them one after the other (lowering/chain.py)
    assert sorted(s.family for s in specs) == ["chain", "gemm", "gemm"]
    for spec in specs:
        for ext in (".ll", ".opt.ll", ".s"):
            assert (tmp_path / f"{spec.symbol}{ext}").stat().st_size > 0
    asm = (tmp_path / f"{specs[0].symbol}.s").read_text()
    wide = "zmm" if host_target().vector_bits == 512 else "ymm"
    assert wide in asm


class TwoTail(Two):
    """Work left for Inductor (an elementwise chain it fuses), so the kernels run as its custom
    ops."""

    def forward(self, x):
        h = super().forward(x)
        return torch.tanh(h) * 2 + h.sigmoid()


class TwoGlue(Two):
    """Besides the kernels only data movement and one add: nothing worth Inductor's compile."""

    def forward(self, x):
        h = super().forward(x)
        return torch.cat([h, h + 1]), torch.arange(3)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_kernels_named_in_profiler_traces(inner):
    torch.manual_seed(3)
    torch._dynamo.reset()
    model = TwoTail().eval()
    compiled = torch.compile(model, backend="kwker", options={"inner": inner})
    x = torch.randn(3, 24)
    with torch.no_grad():
        compiled(x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            compiled(x)
    names = {e.key for e in prof.key_averages()}
    assert {s.symbol for s in kd.last_report().specs} <= names
    if inner == "inductor":
        assert "kwker::linear" in names


def test_fully_lowered_graph_skips_inductor():
    """A graph that is all Kwker kernels, or leaves only data movement and a couple of ops
    besides them, runs as the flat program under the default inner too (Inductor would only add
    its wrappers and its compile); one with work to fuse runs the custom ops."""
    torch.manual_seed(5)
    x = torch.randn(3, 24)
    for model, custom_ops in ((Two().eval(), False), (TwoGlue().eval(), False),
                              (TwoTail().eval(), True)):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="kwker")
        with torch.no_grad():
            compiled(x)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                compiled(x)
        assert ("kwker::linear" in {e.key for e in p.key_averages()}) == custom_ops
        assert kd.last_report().kernel_names == ["linear_relu", "linear"]


def _blocked(spec, target):
    """``spec`` with the register tile and cache blocks lowering picks on ``target`` (a GEMM's
    blocking follows the ISA: 6x24 on an AVX2 host cannot be AVX-512 code)."""
    if spec.family != "gemm":
        return spec
    chosen = blocking.choose(spec.m, spec.n, spec.k, target, b_layout=spec.b_layout,
                             dtype=spec.dtype)
    return dataclasses.replace(spec, **chosen.as_kwargs())


def test_avx512_and_avx2_code_for_the_graphs_kernels():
    """The specs a compiled graph uses, emitted for both ISAs without running them."""
    torch.manual_seed(4)
    _, _, reports = compile_run(Two().eval(), (torch.randn(3, 24),), "eager")
    avx512 = make_target("skylake-avx512", "+avx512f,+avx512bw,+avx512vl,+avx512dq,+avx2,+fma")
    avx2 = make_target("haswell", "+avx2,+fma,-avx512f")
    specs = reports[-1].specs
    assert "chain" in [s.family for s in specs]  # the two linears' caller: no vector code
    for spec in (s for s in specs if s.family != "chain"):
        _, asm512 = compile_assembly(kernel.ir_text(_blocked(spec, avx512), avx512), avx512)
        _, asm256 = compile_assembly(kernel.ir_text(_blocked(spec, avx2), avx2), avx2)
        assert "zmm" in asm512, spec.symbol
        assert "ymm" in asm256 and "zmm" not in asm256, spec.symbol


def test_eager_runner_walks_no_graph_per_call(monkeypatch):
    """After compile, calls run the flat step list: no FX interpreter, no GraphModule code."""
    torch.manual_seed(5)
    model = Two().eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kwker", options={"inner": "eager"})
    x = torch.randn(3, 24)
    with torch.no_grad():
        compiled(x)

        def forbidden(*args, **kwargs):
            raise AssertionError("the graph was walked during a call")

        monkeypatch.setattr(torch.fx.Interpreter, "run_node", forbidden)
        monkeypatch.setattr(torch.fx.GraphModule, "__call__", forbidden)
        assert_close(compiled(x), model(x))
