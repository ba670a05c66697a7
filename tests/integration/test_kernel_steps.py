"""The eager runner's program marks the steps that call Kwker kernels (``step.kernel``)."""
import torch

import kwker.dynamo as kd


def test_kernel_steps_carry_their_kernel_name():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(),
                                torch.nn.Linear(40, 8), torch.nn.Softmax(-1)).eval()
    graphs = []

    def keep(gm, example_inputs):  # the kwker backend, keeping what it hands dynamo
        graphs.append(kd.backend(gm, example_inputs, options={"inner": "eager"}))
        return graphs[-1]

    torch._dynamo.reset()
    x = torch.randn(3, 24)
    with torch.no_grad():
        torch.compile(model, backend=keep)(x)
    (graph,) = graphs
    steps = [s for s, _ in graph.plan.program.steps]
    tagged = [s.kernel for s in steps if getattr(s, "kernel", None)]
    assert tagged == graph.report.kernel_names and tagged  # in program order
    assert len(steps) > len(tagged)  # softmax runs on ATen, untagged
