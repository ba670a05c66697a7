"""Ahead-of-time packages: ``kwker.package`` here, ``kwker.load_package`` in a fresh process.

Every load happens in a subprocess (``package_worker.py``) that imports no model code, with a
kernel cache of its own, so what it answers comes from the package file alone; answers are
compared with eager here. The child also reports whether dynamo was imported and what the
kernel runtime did (compiles, objects taken from the package).
"""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import kwker
from kwker.lowering.exported import ExportError
from kwker.runtime.target import host_target

from .models import DecoderBlock, Ranker, assert_bf16_contract, assert_close

WORKER = Path(__file__).with_name("package_worker.py")
OTHER_CPU = "haswell"  # AVX2 + FMA: runs on every CPU these tests run on, and is never the host


def _export(model, example, dims):
    return torch.export.export(model, example, dynamic_shapes=dims)


def serve(tmp_path, mode, package, cases, env=None, name="out"):
    """Run the worker; (its answers, its report dict)."""
    cases_file = tmp_path / f"{name}-cases.pt"
    torch.save(cases, cases_file)
    out = tmp_path / f"{name}.json"
    cache = tmp_path / f"{name}-cache"
    full_env = {**os.environ, "KWKER_CACHE_DIR": str(cache), **(env or {})}
    r = subprocess.run([sys.executable, str(WORKER), mode, str(package), str(cases_file),
                        str(out)], env=full_env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads(out.read_text())
    info["stderr"] = r.stderr
    return torch.load(str(out) + ".pt"), info


@pytest.fixture(scope="module")
def ranker_package(tmp_path_factory):
    torch.manual_seed(0)
    model = Ranker().eval()
    batch = torch.export.Dim("batch", min=1, max=256)
    ep = _export(model, (torch.randn(4, 64),), ({0: batch},))
    path = kwker.package(ep, tmp_path_factory.mktemp("pkg") / "ranker.kwk",
                         targets=[OTHER_CPU])
    return model, path


def _ranker_cases():
    torch.manual_seed(1)
    return [(torch.randn(b, 64),) for b in (1, 13, 256, 32)]


def test_round_trip_matches_eager_without_dynamo_or_compiles(ranker_package, tmp_path):
    model, path = ranker_package
    cases = _ranker_cases()
    answers, info = serve(tmp_path, "run", path, cases)
    assert not info["dynamo"], "loading a package imported dynamo"
    assert info["stats"]["misses"] == 0, info["stats"]  # no LLVM compile: code from the file
    assert info["stats"]["packaged"] > 0
    assert info["kernels"] and not info["missed"], info
    for (x,), (values, indices) in zip(cases, answers):
        ref = model(x)
        assert values.shape == (x.shape[0], 10)
        assert_close(values, ref.values)
        assert (indices == ref.indices).float().mean() > 0.99


def test_output_structure_is_the_models(ranker_package, tmp_path):
    """The Ranker returns ``torch.topk(...)``: the loaded package returns a ``return_types.topk``
    too (``torch.export.save`` itself cannot store that structure)."""
    _, path = ranker_package
    code = ("import sys, torch, kwker; m = kwker.load_package(sys.argv[1]); "
            "r = m(torch.randn(3, 64)); print(type(r).__name__, r.indices.shape)")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                       env={**os.environ, "KWKER_CACHE_DIR": str(tmp_path)}, check=True)
    assert r.stdout.split()[0] == "topk" and "[3, 10]" in r.stdout


def test_the_exported_program_is_kept(ranker_package):
    """Off the load path, for re-lowering: the same graph and weights, answering as the model
    does; the weights are stored once in the file (weights.bin), not again in the program."""
    model, path = ranker_package
    ep = kwker.exported_program(path)
    x = torch.randn(5, 64)
    values, indices = ep.module()(x)
    assert torch.equal(values, model(x).values) and torch.equal(indices, model(x).indices)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert ep.state_dict.keys() == state.keys()
    for key, t in ep.state_dict.items():
        assert torch.equal(t, state[key]) and type(t) is type(state[key])
    with zipfile.ZipFile(path) as z:
        sizes = {i.filename: i.file_size for i in z.infolist()}
    assert sizes["exported.pt2"] < sizes["weights.bin"] // 10, sizes


def test_bad_inputs_are_refused_with_a_message(ranker_package, tmp_path):
    _, path = ranker_package
    cases = [(), (torch.randn(2, 64), torch.randn(2, 64)), ([[0.0] * 64],),
             (torch.randn(2, 64, dtype=torch.float64),), (torch.randn(64),),
             (torch.randn(2, 63),), (torch.randn(257, 64),), (torch.empty(2, 64, device="meta"),)]
    _, info = serve(tmp_path, "errors", path, cases)
    got = info["errors"]
    assert all(g is not None for g in got), got
    kinds = [g[0] for g in got]
    assert kinds == ["TypeError", "TypeError", "TypeError"] + ["RuntimeError"] * 5, got
    assert "1 input(s) (x)" in got[0][1]
    assert "float32" in got[3][1] and "float64" in got[3][1]
    assert "rank 2" in got[4][1]
    assert "size 64 in dim 1" in got[5][1]
    assert "1..256" in got[6][1] and "257" in got[6][1]
    assert "meta" in got[7][1]


def test_non_contiguous_inputs_are_served(ranker_package, tmp_path):
    model, path = ranker_package
    x = torch.randn(64, 9).t()  # (9, 64), column-major
    answers, _ = serve(tmp_path, "run", path, [(x,)])
    assert_close(answers[0][0], model(x).values)


def test_corrupted_truncated_and_foreign_files_are_refused(ranker_package, tmp_path):
    _, path = ranker_package
    data = path.read_bytes()
    bad = {}
    bad["truncated"] = data[:len(data) // 2]
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("weights.bin")
    flipped = bytearray(data)
    flipped[info.header_offset + 200] ^= 0xFF  # inside the stored weights
    bad["flipped"] = bytes(flipped)
    bad["foreign"] = os.urandom(4096)
    bad["empty"] = b""
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    manifest = json.loads(members["kwker-package.json"])
    manifest["programs"]["model"]["graph"]["nodes"][0]["target"] = "aten::no_such_op.default"
    edited = json.dumps(manifest).encode()
    bad["edited"] = _zip(tmp_path / "edited.zip", {**members, "kwker-package.json": edited})
    import hashlib
    rehashed = {**members, "kwker-package.json": edited,
                "INTEGRITY": hashlib.sha256(edited).hexdigest().encode()}
    bad["unknown op"] = _zip(tmp_path / "op.zip", rehashed)
    newer = dict(json.loads(members["kwker-package.json"]), kwker_package=99)
    text = json.dumps(newer).encode()
    bad["newer format"] = _zip(tmp_path / "fmt.zip", {
        **members, "kwker-package.json": text, "INTEGRITY": hashlib.sha256(text).hexdigest()
        .encode()})
    bad["no manifest"] = _zip(tmp_path / "plain.zip", {"hello.txt": b"hi"})
    paths = []
    for name, content in bad.items():
        p = tmp_path / f"{name.replace(' ', '_')}.kwk"
        p.write_bytes(content)
        paths.append(str(p))
    paths.append(str(tmp_path / "missing.kwk"))
    _, info = serve(tmp_path, "load", path, paths)
    got = dict(zip([*bad, "missing"], info["load_errors"]))
    for name, g in got.items():
        assert g is not None and g[0] == "PackageError", (name, g)
    assert "corrupted" in got["flipped"][1] and "weights.bin" in got["flipped"][1]
    assert "corrupted" in got["edited"][1] and "checksum" in got["edited"][1]
    assert "not a Kwker package" in got["foreign"][1]
    assert "no_such_op" in got["unknown op"][1]
    assert "format 99" in got["newer format"][1]
    assert "does not exist" in got["missing"][1]


def test_a_package_from_another_kwker_version_is_lowered_again(ranker_package, tmp_path):
    """Another Kwker (codegen) version: its object code does not apply (one log line says
    so); the graph is lowered and compiled here, and answers as before."""
    import hashlib
    model, path = ranker_package
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    manifest = json.loads(members["kwker-package.json"])
    manifest["versions"]["kwker"] = "0.0.1+000000000000"
    text = json.dumps(manifest).encode()
    old = tmp_path / "old.kwk"
    _zip(old, {**members, "kwker-package.json": text,
               "INTEGRITY": hashlib.sha256(text).hexdigest().encode()})
    cases = _ranker_cases()[:2]
    answers, info = serve(tmp_path, "run", old, cases)
    assert "was built by kwker 0.0.1+000000000000" in info["stderr"]
    assert info["stats"]["packaged"] == 0 and info["stats"]["misses"] > 0
    for (x,), (values, indices) in zip(cases, answers):
        assert_close(values, model(x).values)
    # prewarming it (lowered here, as load does) leaves nothing to compile when loading
    cache = tmp_path / "warm-cache"
    r = subprocess.run([sys.executable, "-m", "cache_tools", "prewarm", "--package", str(old)],
                       env={**os.environ, "KWKER_CACHE_DIR": str(cache)}, capture_output=True,
                       text=True, cwd=Path(__file__).parents[2], check=False)
    assert r.returncode == 0, r.stderr
    _, info = serve(tmp_path, "run", old, cases, name="warm")
    assert info["stats"]["misses"] == 0, info["stats"]


def _zip(path: Path, members: dict) -> bytes:
    with zipfile.ZipFile(path, "w") as z:
        for n, d in members.items():
            z.writestr(n, d)
    return path.read_bytes()


def test_concurrent_calls_from_threads(ranker_package, tmp_path):
    _, path = ranker_package
    _, info = serve(tmp_path, "threads", path, _ranker_cases())
    assert info["threads"] == {"bad": [], "errors": []}


def _other_env(features: str) -> dict:
    return {"KWKER_CPU": OTHER_CPU, "KWKER_FEATURES": features}


def test_a_packaged_target_loads_without_compiling(ranker_package, tmp_path):
    """The package holds code for ``OTHER_CPU`` too: a process taking that CPU loads it."""
    model, path = ranker_package
    with zipfile.ZipFile(path) as z:
        targets = json.loads(z.read("kwker-package.json"))["targets"]
    other = next(t["target"] for t in targets if t["target"]["cpu"] == OTHER_CPU)
    cases = _ranker_cases()
    answers, info = serve(tmp_path, "run", path, cases, env=_other_env(other["features"]))
    assert info["stats"]["misses"] == 0 and info["stats"]["packaged"] > 0, info["stats"]
    for (x,), (values, _) in zip(cases, answers):
        assert_close(values, model(x).values)


def test_another_cpus_package_compiles_from_its_manifest(tmp_path):
    """A package without code for this CPU: compiled from its manifest into the kernel cache
    (one log line says so), then correct; ``kwker-cache prewarm --package`` does the same
    ahead of time, after which loading compiles nothing."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.GELU(),
                                torch.nn.Linear(96, 24)).eval()
    ep = _export(model, (torch.randn(5, 48),), ({0: torch.export.Dim("b", max=64)},))
    path = kwker.package(ep, tmp_path / "mlp.kwk")  # this CPU only
    env = {"KWKER_CPU": OTHER_CPU, "KWKER_FEATURES": ""}
    cases = [(torch.randn(b, 48),) for b in (1, 7, 64)]
    answers, info = serve(tmp_path, "run", path, cases, env=env, name="cold")
    assert info["stats"]["misses"] > 0
    assert "has no code for this CPU" in info["stderr"]
    for (x,), (y,) in zip(cases, answers):
        assert_close(y, model(x))
    cache = tmp_path / "warm-cache"
    r = subprocess.run([sys.executable, "-m", "cache_tools", "prewarm", "--package", str(path)],
                       env={**os.environ, **env, "KWKER_CACHE_DIR": str(cache)},
                       capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr
    answers, info = serve(tmp_path, "run", path, cases, env=env, name="warm")
    assert info["stats"]["misses"] == 0, info["stats"]


def test_decoder_block_with_dynamic_sequence(tmp_path):
    """Layer norms, views and the residual adds run as ATen calls between the kernels; the
    attention is generic over the sequence length."""
    torch.manual_seed(0)
    model = DecoderBlock(d=96, heads=4).eval()
    seq = torch.export.Dim("seq", min=2, max=200)
    ep = _export(model, (torch.randn(1, 17, 96),), ({1: seq},))
    path = kwker.package(ep, tmp_path / "block.kwk")
    cases = [(torch.randn(1, n, 96),) for n in (2, 31, 200)]
    answers, info = serve(tmp_path, "run", path, cases)
    assert "generic" in info["kernels"], info
    for (x,), (y,) in zip(cases, answers):
        assert_close(y, model(x))


def test_bf16_model(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64)).eval()
    low = _copy_bf16(model)
    ep = _export(low, (torch.randn(3, 64, dtype=torch.bfloat16),),
                 ({0: torch.export.Dim("b", max=128)},))
    path = kwker.package(ep, tmp_path / "bf16.kwk")
    cases = [(torch.randn(b, 64),) for b in (1, 5, 128)]
    answers, info = serve(tmp_path, "run", path, [(x.bfloat16(),) for (x,) in cases])
    assert info["kernels"] and not info["missed"], info
    for (x,), (y,) in zip(cases, answers):
        assert y.dtype == torch.bfloat16
        assert_bf16_contract(y, low(x.bfloat16()), model(x))


def test_a_package_follows_the_float32_precision_it_is_loaded_under(tmp_path):
    """A float32 package built at full precision: loaded under
    ``torch.set_float32_matmul_precision("medium")`` its linears take bf16 products where the
    CPU has fast ones (README, "Float32 matmul precision"), and at "highest" float32 again."""
    import copy

    from kwker.kernels import blocking
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64)).eval()
    x = torch.randn(24, 64)
    path = kwker.package(_export(model, (x,), None), tmp_path / "mlp.kwk")
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(x.double())
    before, errors = torch.get_float32_matmul_precision(), {}
    try:
        for setting in ("medium", "highest"):
            torch.set_float32_matmul_precision(setting)
            y = kwker.load_package(path)(x)
            y = y[0] if isinstance(y, (tuple, list)) else y
            errors[setting] = ((y.double() - reference).abs().max()
                               / reference.abs().max()).item()
    finally:
        torch.set_float32_matmul_precision(before)
    assert errors["highest"] < 1e-5, errors
    assert (errors["medium"] > 1e-4) == blocking.fast_bf16() and errors["medium"] < 1e-2, errors


def _copy_bf16(model):
    import copy
    return copy.deepcopy(model).to(torch.bfloat16)


def test_programs_a_package_cannot_hold_are_refused_at_package_time(tmp_path):
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls.add_(1)
            return x * 2
    ep = torch.export.export(Counter(), (torch.randn(3),))
    with pytest.raises(ExportError, match="mutates"):
        kwker.package(ep, tmp_path / "counter.kwk")
    assert not (tmp_path / "counter.kwk").exists()


def test_extra_target_strings(tmp_path):
    """``cpu:features`` targets are taken as given, the host is never duplicated, and code for
    a CPU with features this one lacks (AVX-512 and AMX here) is compiled without being run."""
    model = torch.nn.Linear(16, 8).eval()
    ep = torch.export.export(model, (torch.randn(2, 16),))
    host = host_target()
    path = kwker.package(ep, tmp_path / "lin.kwk",
                         targets=[host.cpu + ":" + host.features, f"{OTHER_CPU}:+avx2,+fma",
                                  "sapphirerapids"])
    with zipfile.ZipFile(path) as z:
        manifest = json.loads(z.read("kwker-package.json"))
        objects = [n for n in z.namelist() if n.startswith("objects/")]
    targets = manifest["targets"]
    assert [t["target"]["cpu"] for t in targets] == [host.cpu, OTHER_CPU, "sapphirerapids"]
    assert targets[1]["target"]["features"] == "+avx2,+fma"
    assert "+avx512f" in targets[2]["target"]["features"]
    assert len(objects) == sum(len(t["objects"]) for t in targets) and all(
        t["objects"] for t in targets)
    x = torch.randn(2, 16)
    assert_close(kwker.load_package(path)(x), model(x))


def test_written_out_gelu_is_fused_in_a_package(tmp_path):
    """GPT-2's GELU spelled in arithmetic (transformers' NewGELUActivation) reaches a package as
    ATen ops; it is recognised there as under torch.compile and fused into the linear."""
    import math

    class NewGELUMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

        def forward(self, x):
            h = self.up(x)
            h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) *
                                            (h + 0.044715 * torch.pow(h, 3.0))))
            return self.down(h)
    torch.manual_seed(0)
    model = NewGELUMLP().eval()
    ep = _export(model, (torch.randn(3, 64),), ({0: torch.export.Dim("b", max=64)},))
    path = kwker.package(ep, tmp_path / "gelu.kwk")
    cases = [(torch.randn(b, 64),) for b in (1, 17)]
    answers, info = serve(tmp_path, "run", path, cases)
    assert sorted(info["names"]) == ["linear", "linear_gelu_tanh"] and not info["aten"], info
    for (x,), (y,) in zip(cases, answers):
        assert_close(y, model(x))


def test_llama_style_norm_and_swiglu_are_kernels_in_a_package(tmp_path):
    """transformers' written-out RMSNorm (its input cast elided by torch.export when it has the
    dtype already, the input read again for the residual) and SwiGLU's silu(gate) * up reach a
    package as ATen ops and are Kwker kernels there, as under torch.compile."""
    class Block(torch.nn.Module):
        def __init__(self, d=64, hidden=160):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(d) + 0.5)
            self.gate = torch.nn.Linear(d, hidden, bias=False)
            self.up = torch.nn.Linear(d, hidden, bias=False)
            self.down = torch.nn.Linear(hidden, d, bias=False)

        def forward(self, x):
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            h = self.weight * h.to(x.dtype)
            return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))
    torch.manual_seed(0)
    model = Block().eval()
    ep = _export(model, (torch.randn(2, 7, 64),), ({1: torch.export.Dim("s", max=128)},))
    path = kwker.package(ep, tmp_path / "block.kwk")
    cases = [(torch.randn(2, n, 64),) for n in (1, 33)]
    answers, info = serve(tmp_path, "run", path, cases)
    assert {"rms_norm", "silu_mul"} <= set(info["names"]), info
    for (x,), (y,) in zip(cases, answers):
        assert_close(y, model(x))


def test_rotary_embedding_is_a_kernel_in_a_package(tmp_path):
    """transformers' ``apply_rotary_pos_emb`` reaches a package as ATen slices, a negation, a
    cat, products and a sum, and is the rope kernel there."""
    tf = pytest.importorskip("transformers.models.llama.modeling_llama")

    class Rotary(torch.nn.Module):
        def __init__(self, d=64, heads=2, kv_heads=1):
            super().__init__()
            self.heads, self.kv, self.hd = heads, kv_heads, d // heads
            self.q = torch.nn.Linear(d, d, bias=False)
            self.k = torch.nn.Linear(d, self.hd * kv_heads, bias=False)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
            k = self.k(x).view(b, t, self.kv, self.hd).transpose(1, 2)
            return tf.apply_rotary_pos_emb(q, k, cos, sin)
    torch.manual_seed(0)
    model = Rotary().eval()

    def inputs(t):
        angles = torch.arange(t)[:, None] * torch.rand(16)[None]
        emb = torch.cat((angles, angles), -1)[None]
        return torch.randn(2, t, 64), emb.cos(), emb.sin()
    seq = torch.export.Dim("s", max=128)
    ep = _export(model, inputs(7), ({1: seq}, {1: seq}, {1: seq}))
    path = kwker.package(ep, tmp_path / "rotary.kwk")
    cases = [inputs(t) for t in (1, 33)]
    answers, info = serve(tmp_path, "run", path, cases)
    assert info["names"].count("rope") == 2, info
    for case, got in zip(cases, answers):
        for g, want in zip(got, model(*case)):
            assert_close(g, want)


def test_empty_constants_leave_the_exported_program_whole(tmp_path):
    """A program with an empty tensor constant (transformers' caches start from ``tensor([])``)
    keeps its exported copy, the weights back in it."""
    class StartsEmpty(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 8)

        def forward(self, x):
            return torch.cat([torch.tensor([]), self.lin(x).flatten()])

    torch.manual_seed(0)
    model, x = StartsEmpty().eval(), torch.randn(3, 16)
    path = kwker.package(torch.export.export(model, (x,)), tmp_path / "empty.kwk")
    (kept,) = kwker.exported_program(path).module()(x)
    assert torch.equal(kept, model(x))


@pytest.mark.parametrize("dim", [torch.export.Dim.DYNAMIC, torch.export.Dim("rows", min=2)],
                         ids=["Dim.DYNAMIC", "no max"])
def test_unbounded_dynamic_sizes(dim, tmp_path):
    """A size exported without an upper bound (``Dim.DYNAMIC``, or a ``Dim`` with no max: torch
    records the range's end as its ``int_oo``) is packaged as unbounded and served at any size."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.GELU()).eval()
    ep = torch.export.export(model, (torch.randn(4, 32),), dynamic_shapes=({0: dim},))
    packaged = kwker.load_package(kwker.package(ep, tmp_path / "rows.kwk"))
    for rows in (3, 1000):
        x = torch.randn(rows, 32)
        assert_close(packaged(x), model(x))
