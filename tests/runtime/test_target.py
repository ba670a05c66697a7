"""A CPU named without features (KWKER_CPU alone, make_target(cpu, "")) gets the features LLVM
gives that name; explicit features win; a name LLVM does not know is a clear error."""
import json
import os
import subprocess
import sys

import pytest

from kwker.runtime import target as T
from kwker.runtime.target import UnknownCPU, host_target, make_target


@pytest.fixture
def env_target(monkeypatch):
    """``get(cpu, features)``: host_target() under KWKER_CPU/KWKER_FEATURES (None = unset)."""
    def get(cpu, features=None):
        for name, value in (("KWKER_CPU", cpu), ("KWKER_FEATURES", features)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        host_target.cache_clear()
        return host_target()

    yield get
    monkeypatch.undo()
    host_target.cache_clear()  # the next caller sees the real environment again


def test_znver3_implies_avx2_and_fma(env_target):
    for t in (env_target("znver3"), env_target("znver3", ""), make_target("znver3", "")):
        assert t.cpu == "znver3"
        assert t.has("avx2") and t.has("fma") and t.has("avx") and t.has("bmi2")
        assert not t.has("avx512f") and t.vector_bits == 256, t
        assert t.describe() == "znver3 (AVX2, FMA)"


def test_znver4_implies_avx512_with_bf16(env_target):
    for t in (env_target("znver4"), make_target("znver4")):
        assert all(t.has(f) for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq",
                                      "avx512bf16", "avx2", "fma")), t
        assert not t.has("avx512fp16") and t.vector_bits == 512


def test_skylake_avx512_has_no_bf16():
    t = make_target("skylake-avx512", "")
    assert t.has("avx512f") and t.has("avx512bw") and t.has("avx512vl") and t.vector_bits == 512
    assert not t.has("avx512bf16") and not t.has("avx512vbmi")


# what each name implies, per Intel's and AMD's manuals (and LLVM's X86.td): vector width, then
# features it must have and must not have
NAMED = {
    "x86-64": (128, (), ("sse4.2", "popcnt", "avx")),
    "x86-64-v2": (128, ("sse4.2", "popcnt"), ("avx", "avx2")),
    "x86-64-v3": (256, ("avx2", "fma", "bmi2", "f16c", "lzcnt"), ("avx512f",)),
    "x86-64-v4": (512, ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"),
                  ("avx512bf16", "avx512vbmi")),
    "haswell": (256, ("avx2", "fma", "bmi", "bmi2"), ("avx512f",)),
    "broadwell": (256, ("avx2", "fma"), ("avx512f",)),
    "skylake": (256, ("avx2", "fma"), ("avx512f",)),
    "cascadelake": (512, ("avx512f", "avx512vl"), ("avx512bf16",)),
    "cooperlake": (512, ("avx512bf16",), ("avx512vbmi", "avx512fp16")),
    "icelake-server": (512, ("avx512vbmi", "avx512vbmi2", "avx512vpopcntdq"), ("avx512bf16",)),
    "sapphirerapids": (512, ("avx512bf16", "avx512fp16"), ()),
    "znver1": (256, ("avx2", "fma"), ("avx512f",)),
    "znver2": (256, ("avx2", "fma"), ("avx512f",)),
    "znver5": (512, ("avx512bf16", "avx512vbmi2"), ("avx512fp16",)),
    "bdver2": (128, ("avx", "sse4.2", "f16c"), ("avx2", "fma")),  # FMA4 and XOP, no FMA3
}


@pytest.mark.parametrize("cpu", sorted(NAMED))
def test_named_cpus(cpu):
    bits, have, lack = NAMED[cpu]
    t = make_target(cpu, "")
    assert t.vector_bits == bits, t
    assert [f for f in have if not t.has(f)] == [] and [f for f in lack if t.has(f)] == [], t
    # same format as the host's string: every _INTERESTING feature, in order, + or -
    assert [f[1:] for f in t.features.split(",")] == list(T._INTERESTING)


@pytest.mark.parametrize("feature", T._INTERESTING)
def test_each_probe_sees_its_feature_both_ways(feature):
    """Each probe answers for its own feature: on when added to the baseline x86-64, off when
    removed from a CPU that has every feature Kwker asks about. (LLVM lowers bf16 conversions
    with AVX512_BF16 only together with AVX512VL, which every CPU that has it also has.)"""
    extra = ",+avx512vl" if feature == "avx512bf16" else ""
    assert T.llvm_features("x86-64", f"+{feature}{extra}")[feature] is True
    assert T.llvm_features("sapphirerapids", f"-{feature}")[feature] is False


def test_host_cpu_name_gives_the_host_features_here():
    """On a CPU LLVM knows and that runs unvirtualised features, the name implies what the host
    reports (a VM that hides AVX-512 would differ: then it is not this test's business)."""
    import llvmlite.binding as llvm
    name = llvm.get_host_cpu_name()
    if name not in ("znver4", "znver5", "sapphirerapids", "haswell", "skylake-avx512"):
        pytest.skip(f"not checked for {name}")
    assert T.cpu_features(name) == T._host_features()


@pytest.mark.parametrize("cpu,message", [
    ("znver9", "does not know the CPU name 'znver9' (did you mean 'znver5'"),
    ("bogus", "does not know the CPU name 'bogus'"),
    ("i686", "cannot compile x86-64 code for the CPU 'i686'")])
def test_unknown_name_is_a_clear_error(cpu, message, env_target):
    with pytest.raises(UnknownCPU, match="KWKER_FEATURES") as e:
        make_target(cpu, "")
    assert message in str(e.value)
    with pytest.raises(UnknownCPU):
        env_target(cpu)
    with pytest.raises(UnknownCPU):
        env_target(cpu, "")


def test_explicit_features_win(env_target):
    t = env_target("znver4", "+avx,+avx2,+fma,-avx512f")
    assert t.features == "+avx,+avx2,+fma,-avx512f" and t.vector_bits == 256
    assert make_target("znver4", "+avx2,-avx512f").features == "+avx2,-avx512f"
    # features alone keep the host's name
    import llvmlite.binding as llvm
    t = env_target(None, "+sse4.2,-avx")
    assert (t.cpu, t.features, t.vector_bits) == (llvm.get_host_cpu_name(), "+sse4.2,-avx", 128)


def test_no_override_is_the_host(env_target):
    t = env_target(None)
    assert t.features == T._host_features()


def test_cache_cli_reports_the_named_cpus_features(tmp_path):
    env = dict(os.environ, KWKER_CPU="znver3", KWKER_CACHE_DIR=str(tmp_path / "c"))
    env.pop("KWKER_FEATURES", None)
    r = subprocess.run([sys.executable, "-m", "cache_tools", "info", "--json"], env=env,
                       capture_output=True, text=True, check=False)
    target = json.loads(r.stdout)["target"]
    assert target["features"] == make_target("znver3").features
    assert target["description"] == "znver3 (AVX2, FMA)"
    r = subprocess.run([sys.executable, "-m", "cache_tools", "info"],
                       env=dict(env, KWKER_CPU="znver9"), capture_output=True, text=True,
                       check=False)
    assert r.returncode == 1 and "does not know the CPU name 'znver9'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_emulated_tiles_compile_at_the_lower_level():
    """Emulated tile kernels only check the tile logic: they compile at ``EMULATED_OPT``, every
    other target at its own level (the cache key holds the target, so neither reuses the other's
    objects)."""
    emulated = make_target("sapphirerapids", tiles="emulated")
    native = make_target("sapphirerapids", tiles="amx")
    vector = make_target("sapphirerapids", tiles="")
    assert emulated.compile_level == T.EMULATED_OPT < emulated.opt_level
    assert native.compile_level == vector.compile_level == native.opt_level == 3
    assert emulated != native
