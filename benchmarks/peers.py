"""The peers bench_models.py runs side by side with Kwker: ONNX Runtime and OpenVINO.

Each builder returns ``(call, how)``: a zero-argument call from torch tensors to torch tensors
(``Tensor.numpy()`` in, ``torch.from_numpy`` out: zero-copy) and how the model got there.
A peer whose packages are missing is skipped with ``NOT_INSTALLED``.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import warnings

import torch

PEERS = ("onnxruntime", "openvino")
# what each peer needs importable (ONNX Runtime runs the torch.onnx export, which needs onnx and
# onnxscript; OpenVINO converts the torch module itself, the ONNX file only as a fallback)
PEER_MODULES = {"onnxruntime": ("onnxruntime", "onnx", "onnxscript"), "openvino": ("openvino",)}
NOT_INSTALLED = 'not installed: pip install -e ".[bench]"'
SETTLE = 0.04  # s between samples when peers run: ONNX Runtime's idle workers spin ~30 ms


def peer_missing(peer: str) -> str | None:
    """Why ``peer`` cannot run here (a package it needs is not importable), or None."""
    absent = [m for m in PEER_MODULES[peer] if importlib.util.find_spec(m) is None]
    return f"{NOT_INSTALLED} ({', '.join(absent)} missing)" if absent else None


@contextlib.contextmanager
def _quiet():
    """Silence the converters' warnings and log lines (torchvision absent, deprecations)."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def export_onnx(model, inputs, path: str) -> str:
    """Write ``model`` to ``path`` as ONNX; return which exporter did it: torch's dynamo-based
    exporter (its recommended one) or, when that fails, the TorchScript one."""
    with _quiet():
        try:
            torch.onnx.export(model, inputs, path, dynamo=True, verbose=False)
            return "torch.onnx dynamo export"
        except Exception as e:  # noqa: BLE001 - any failure: the legacy exporter may still work
            why = type(e).__name__
        torch.onnx.export(model, inputs, path, dynamo=False)
    return f"torch.onnx TorchScript export (the dynamo exporter failed: {why})"


def _to_torch(outs):
    """The peers' numpy outputs as torch tensors (zero-copy), a tuple when there are several."""
    out = tuple(torch.from_numpy(o) for o in outs)
    return out if len(out) > 1 else out[0]


def onnxruntime_call(model, inputs, onnx_file):
    """(call, how): an ONNX Runtime session on the exported model, CPU execution provider, all
    graph optimisations, sequential execution, torch's thread count."""
    import onnxruntime as ort

    path, how = onnx_file()
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]

    def run():
        return _to_torch(sess.run(None, {n: t.numpy() for n, t in zip(names, inputs)}))
    return run, how


def openvino_call(model, inputs, onnx_file, precision: str = "f32", feed=None):
    """(call, how): OpenVINO's CPU plugin on the converted torch module (the ONNX file when the
    module does not convert), latency hint, torch's thread count, ``precision`` inference:
    "f32" by default (OpenVINO's own default on a CPU with AVX-512 BF16 is bf16, whose results
    differ from eager's by ~1e-3), "bf16" for the bf16 section. ``model`` and ``inputs`` are
    float32; each call feeds ``feed`` (default ``inputs``), bf16 tensors converted to float32
    inside the call (OpenVINO's bf16 is an execution precision: inputs and outputs stay
    float32)."""
    import openvino as ov

    with _quiet():
        try:
            converted, how = ov.convert_model(model, example_input=inputs), "convert_model(module)"
        except Exception as e:  # noqa: BLE001 - e.g. TorchScript tracing fails: use ONNX
            path, exported = onnx_file()
            converted = ov.convert_model(path)
            how = (f"convert_model(ONNX file from {exported}); the module did not convert: "
                   f"{type(e).__name__}")
    compiled = ov.Core().compile_model(converted, "CPU", {
        "INFERENCE_NUM_THREADS": torch.get_num_threads(), "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_PRECISION_HINT": precision})
    request = compiled.create_infer_request()
    feed = inputs if feed is None else feed

    def run():
        res = request.infer([(t.float() if t.dtype == torch.bfloat16 else t).numpy()
                             for t in feed], share_inputs=True)
        return _to_torch(res.to_tuple())
    return run, f"{how}, {precision}"


PEER_BUILDERS = {"onnxruntime": onnxruntime_call, "openvino": openvino_call}


def onnxruntime_bf16(model, inputs, path: str) -> str:
    """What ONNX Runtime's CPU execution provider does with a bf16 model: export it, open a
    session; returns why it is not timed (the error, or that numpy cannot feed bf16)."""
    import onnxruntime as ort

    try:
        how = export_onnx(model, inputs, path)
    except Exception as e:  # noqa: BLE001 - reported in the table
        return f"bf16 export failed: {type(e).__name__}: {_line(e)}"
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 3  # its constant-folding warnings about bf16 nodes: noise
        ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - e.g. NOT_IMPLEMENTED: no bf16 Gemm kernel
        return f"{how}; session: {type(e).__name__}: {_line(e)}"
    return f"{how}; session built, not timed (numpy has no bfloat16 to feed it)"


def _line(e: Exception, n: int = 200) -> str:
    text = (str(e).splitlines() or [""])[0]
    return text.split(" : ")[-1][:n] if " : " in text else text[:n]
