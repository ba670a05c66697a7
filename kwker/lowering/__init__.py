"""From dynamo's FX graph to Kwker kernels plus the inner compiler.

The stages, in order (each module imports only earlier ones):

    ops.py         what a node computes, however dynamo spelled it
    report.py      which nodes became kernels, logged under the "kwker" logger
    decompose.py   fused TransformerEncoderLayer / MultiheadAttention ops -> primitives
    shapes.py      concrete (or dynamo's symbolic) shapes, strides and dtypes of every node
    patterns.py    nodes -> Matches: which kernel replaces which nodes (structure only)
    build.py       Match + concrete sizes -> callable running a Kwker kernel (kwker.kernels)
    runner.py      inner="eager": the flat list of native calls
    partition.py   inner="eager": kernels + ATen steps per shape specialisation
    custom_ops.py  inner="inductor": torch.ops.kwker.* with fake implementations
    inductor.py    inner="inductor": rewrite the graph to the custom ops, then compile_fx
"""
