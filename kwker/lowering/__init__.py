"""From dynamo's FX graph to Kwker kernels plus the inner compiler.

The stages, in order (each module imports only earlier ones):

    ops.py         what a node computes, however dynamo spelled it
    report.py      which nodes became kernels, logged under the "kwker" logger
    decompose.py   fused TransformerEncoderLayer / MultiheadAttention ops -> primitives
    shapes.py      concrete (or dynamo's symbolic) shapes, strides and dtypes of every node
    patterns.py    nodes -> Matches: which kernel replaces which nodes (structure only);
                   gqa.py: grouped-query attention's repeated k/v heads, read unrepeated
    generic.py     which sizes of an op vary: the key of its size-generic kernel
    make.py        kernel factories by name; the specs of every kernel a lowering builds
    build.py       Match + sizes -> callable running a Kwker kernel (specialised to int sizes,
                   generic over symbolic ones; a new size never waits for a compile);
                   build_attention.py: attention's builder
    runner.py      inner="eager": the flat list of native calls
    partition.py   inner="eager": kernels + ATen steps, one program per graph
    custom_ops.py  inner="inductor": torch.ops.kwker.* with symbolic-size fake implementations
    inductor.py    inner="inductor": rewrite the graph to the custom ops, then compile_fx (or
                   the flat program when nothing is left for Inductor)
"""
