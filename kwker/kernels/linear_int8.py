"""``make_linear_u8s8``: ``(x_u8 @ W_s8.T) * scale + bias`` on int8 matrix tiles (``tdpbusd``).

The groundwork of low-bit weights: u8 activations (a quantised layer's input, zero point folded
into the caller's bias) times s8 weights, summed exactly in int32, then one float32 conversion,
one multiplication by the column's scale and one addition of its bias: the result equals that
float32 arithmetic on the exact integer sums. Runs on the tile path (AMX-INT8, or the emulated
target), else on ``vpdpbusd`` (AVX512_VNNI: the same nest's vector micro-kernel, gemm_micro.py),
with the weights packed once in AMX's int8 B layout either way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..codegen.gemm_tile import STEP, TILE_BLOCK
from ..runtime.target import host_target
from . import blocking
from ._call import checked, entry
from .specs import GemmSpec


def pack_int8_panels(w: torch.Tensor, nr: int, k_step: int = STEP) -> torch.Tensor:
    """(N, K) int8 -> int32 words (panels, ceil(K/4) rounded up to ``k_step``, nr): the four
    int8 of k 4p .. 4p + 3 of a column in one word (AMX's B layout), zero past N and K."""
    n, k = w.shape
    kq = -(-k // 4)
    np_ = -(-n // nr)
    padded = torch.zeros(np_ * nr, -(-kq // k_step) * k_step * 4, dtype=torch.int8)
    padded[:n, :k] = w
    words = padded.view(np_, nr, -1, 4).permute(0, 2, 1, 3).contiguous()
    return words.view(torch.int32).view(np_, -1, nr)


def make_linear_u8s8(weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                     m: int | None = None, epilogue: str = "none"):
    """``callable(x (m, K) uint8) -> (m, N) float32``; ``m=None``: any row count."""
    target = host_target()
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"make_linear_u8s8: weight must be (N, K) int8, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    if tuple(scale.shape) != (n,) or (bias is not None and tuple(bias.shape) != (n,)):
        raise ValueError(f"make_linear_u8s8: scale and bias must be ({n},)")
    kk = -(-k // 4) * 4
    blk = blocking.int8_blocking(n, kk // 4, target)
    if blk is None:
        raise NotImplementedError(f"make_linear_u8s8 runs on AMX-INT8 tiles or AVX512_VNNI; "
                                  f"this target is {target.describe()}")
    nr = TILE_BLOCK[1]
    np_ = -(-n // nr)
    spec = GemmSpec(m or 0, n, kk, 1, "packed", bias is not None, epilogue, False,
                    **blk.as_kwargs(), dtype="u8s8")
    fn = entry(spec, 5, 1 if m else 2)
    packed = pack_int8_panels(weight.detach(), nr)
    consts = torch.zeros(2 * np_ * nr)
    consts[:n] = scale.detach().float()
    if bias is not None:
        consts[np_ * nr:np_ * nr + n] = bias.detach().float()
    threads = torch.get_num_threads

    def run(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else -1
        if m is not None and rows != m:
            raise ValueError(f"make_linear_u8s8: built for {m} rows, got {tuple(x.shape)}")
        x = checked(x, (rows, k), "int8 linear input", torch.uint8)
        if kk != k:
            x = F.pad(x, (0, kk - k))
        out = torch.empty(rows, n)
        args = [x.data_ptr(), packed.data_ptr(), consts.data_ptr(), None, out.data_ptr()]
        fn(*args, threads()) if m else fn(*args, rows, threads())
        return out

    run.spec, run.packed_weight, run.consts = spec, packed, consts
    return run
