"""Shared by the low-bit linear tests: torchao's formats, quantised layers and the float64
reference (``x @ ((q - zp) * scale).T`` from torchao's own tensors)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

torchao = pytest.importorskip("torchao")
from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, MappingType, quantize_
from torchao.quantization.granularity import PerAxis, PerGroup

from kwker.kernels.linear_lowbit import dequantized

FORMATS = {
    "int8-channel": (Int8WeightOnlyConfig, {}),
    "int8-group32": (Int8WeightOnlyConfig, {"granularity": PerGroup(32)}),
    "intx8-axis": (IntxWeightOnlyConfig, {"weight_dtype": torch.int8,
                                          "granularity": PerAxis(0)}),
    "int4-group32": (IntxWeightOnlyConfig, {"weight_dtype": torch.int4,
                                            "granularity": PerGroup(32)}),
    "int4-group64-asym": (IntxWeightOnlyConfig, {"weight_dtype": torch.int4,
                                                 "granularity": PerGroup(64),
                                                 "mapping_type": MappingType.ASYMMETRIC}),
    "int4-group64": (IntxWeightOnlyConfig, {"weight_dtype": torch.int4,
                                            "granularity": PerGroup(64)}),
    "int4-group128": (IntxWeightOnlyConfig, {"weight_dtype": torch.int4,
                                             "granularity": PerGroup(128)}),
    "int4-axis": (IntxWeightOnlyConfig, {"weight_dtype": torch.int4,
                                         "granularity": PerAxis(0)}),
    "int2-group32": (IntxWeightOnlyConfig, {"weight_dtype": torch.int2,
                                            "granularity": PerGroup(32)}),
}
EPILOGUES = {"none": lambda y: y, "relu": F.relu, "silu": F.silu, "gelu": F.gelu,
             "gelu_tanh": lambda y: F.gelu(y, approximate="tanh")}


def quantized(fmt: str, n: int, k: int, dtype=torch.float32, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n).to(dtype)
    config, kwargs = FORMATS[fmt]
    quantize_(lin, config(**kwargs))
    return lin


def reference(lin: nn.Linear, x, epilogue="none", res=None, dtype=torch.float32):
    w = dequantized(lin.weight).double()
    y = x.double() @ w.T + lin.bias.detach().to(dtype).double()
    y = EPILOGUES[epilogue](y)
    return y if res is None else y + res.double()


def assert_close(y, ref, dtype, what=""):
    assert y.dtype == dtype and y.shape == ref.shape, what
    scale = ref.abs().max().item()
    err = (y.double() - ref).abs().max().item()
    bound = 1e-5 if dtype == torch.float32 else 2 ** -7   # bf16: output (and weight) rounding
    assert err <= bound * scale, f"{what}: error {err:g} against max |ref| {scale:g}"


def shape_for(fmt):
    return (37, 70) if fmt.endswith(("channel", "axis")) else (100, 256)

