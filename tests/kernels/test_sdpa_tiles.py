"""bf16 attention on matrix tiles (codegen/attention_tile.py) against the bf16 contract.

Emulated tiles (``KWKER_TILES=emulate``) run on any AVX512_BF16 CPU in a subprocess; where this
CPU has AMX and the tile state, the same cases run natively here. Cases: causal and not, bool
and float masks, grouped-query heads, generic sizes, key counts that end inside a 16-pair tile
step (the vector tail), head sizes 32, 48, 64, 80, 112 and 128. The native build's assembly
holds tile products and spills no tile; a head size that is no multiple of 16 keeps the vector
path.
"""
import os
import re
import subprocess
import sys

import pytest
import torch

from kwker.kernels.sdpa import make_sdpa
from kwker.kernels.specs import AttentionSpec
from kwker.runtime.compiler import compile_assembly
from kwker.runtime.kernel import ir_text
from kwker.runtime.target import host_target, make_target

sys.path.insert(0, os.path.dirname(__file__))
from test_sdpa_bf16 import errors, inputs  # noqa: E402

BF = torch.bfloat16
CASES = [  # (b, h, lq, lk, e), causal, mask, mask shape, kv heads, generic
    ((2, 4, 128, 128, 32), True, None, None, None, False),
    ((1, 2, 300, 300, 128), True, None, None, None, False),
    ((2, 4, 77, 77, 64), False, None, None, None, False),
    ((3, 2, 33, 45, 32), False, "bool", (3, 1, 33, 45), None, False),
    ((2, 2, 40, 70, 64), False, "float", (1, 2, 40, 70), None, False),
    ((2, 8, 50, 50, 64), True, None, None, 2, False),
    ((2, 4, 77, 100, 32), False, None, None, None, True),
    ((1, 4, 65, 65, 64), True, None, None, 2, True),
    # a generic kernel's keys come in blocks of TILE_KEYS_GENERIC: two blocks, the online
    # softmax rescaling O between them
    ((1, 2, 40, 2100, 32), False, None, None, None, True),
    ((1, 1, 2100, 2100, 32), True, None, None, None, True),
    # head sizes of 16 words but not 32: a contraction step half zeros, a last 16 columns of O
    ((2, 4, 100, 100, 80), True, None, None, None, False),
    ((2, 3, 45, 70, 48), False, "float", (1, 3, 45, 70), None, False),
    ((1, 4, 65, 130, 112), True, None, None, 2, True),
]


def check_case(shape, causal, mask, mask_shape, kvh, generic) -> tuple[bool, str]:
    b, h, lq, lk, e = shape
    q, k, v, am = inputs(b, h, lq, lk, e, e, kvh=kvh, mask=mask, mask_shape=mask_shape)
    if generic:
        pattern = None if mask_shape is None else tuple(1 if d == 1 else 0 for d in mask_shape)
        f = make_sdpa(None, h, None, None, e, e, causal, None, mask, pattern, dtype=BF,
                      kv_heads=kvh)
    else:
        f = make_sdpa(b, h, lq, lk, e, e, causal, None, mask, mask_shape, dtype=BF,
                      kv_heads=kvh)
    if f.spec.path != "tile":
        return False, f"not on the tile path: {f.spec}"
    y = f(q, k, v) if am is None else f(q, k, v, am)
    ours, eager, top = errors(y, q, k, v, am, is_causal=causal)
    ok = ours <= 1.25 * eager + 1e-3 * top
    return ok, f"kwker {ours:.2e} eager {eager:.2e} max {top:.2e}"


def _worker() -> int:
    torch.set_num_threads(2)
    print(host_target().describe())
    bad = 0
    for case in CASES:
        ok, why = check_case(*case)
        bad += not ok
        print(case, "ok" if ok else "FAIL", why)
    if not bad:
        print("all ok")
    return 1 if bad else 0


def test_emulated_tiles(tmp_path):
    if not (host_target().vector_bits == 512 and host_target().has("avx512bf16")):
        pytest.skip("emulated tile attention is AVX512_BF16 code; this CPU is "
                    + host_target().describe())
    env = dict(os.environ, KWKER_TILES="emulate", KWKER_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, __file__, "worker"], env=env, capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0 and "all ok" in r.stdout, r.stdout + r.stderr
    assert "emulated tiles" in r.stdout


@pytest.mark.parametrize("case", CASES, ids=str)
def test_native_tiles(case, threads, native_tiles):
    ok, why = check_case(*case)
    assert ok, why


def test_native_build_holds_tile_products():
    target = make_target("sapphirerapids")
    spec = AttentionSpec(2, 4, 100, 100, 64, 64, True, dtype="bf16", bq=32, bk=128, nr=32,
                         path="tile")
    _, asm = compile_assembly(ir_text(spec, target), target)
    assert re.search(r"\btdpbf16ps\b", asm) and re.search(r"\bldtilecfg\b", asm)
    assert not re.findall(r"tile(?:stored|loadd)\s+[^\n]*(?:\(%rsp|-\d+\(%rbp)", asm)


def test_other_head_sizes_keep_the_vector_path():
    from kwker.codegen.attention_tile import tile_path_fits
    amx = make_target("sapphirerapids")
    assert tile_path_fits(128, 64, 64, amx) and tile_path_fits(None, 32, 32, amx)
    assert tile_path_fits(128, 80, 80, amx) and tile_path_fits(128, 48, 48, amx)
    assert not tile_path_fits(128, 72, 72, amx)       # no multiple of 16
    assert not tile_path_fits(128, 64, 32, amx)       # e != ev
    assert not tile_path_fits(1, 64, 64, amx)         # decode: dot products, no K packing
    assert not tile_path_fits(128, 64, 64, make_target("znver4"))


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    sys.exit(_worker())
