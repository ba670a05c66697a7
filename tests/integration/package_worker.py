"""The serving side of the package tests, run in a fresh process: ``python package_worker.py
MODE PACKAGE CASES OUT``.

It imports no model code: the package alone must answer. ``CASES`` is a ``torch.save`` file of
input tuples; the answers (or the errors) go to ``OUT``, with what the process did besides:
whether dynamo or torchao was imported, and the kernel runtime's counters (compiles, packaged
objects).
"""
import json
import sys
import threading
import time

import torch

t0 = time.perf_counter()
import kwker


def _flat(out):
    return list(out) if isinstance(out, tuple) else [out]


def run(path, cases):
    model = kwker.load_package(path)
    return [_flat(model(*args)) for args in cases], model


def threads(path, cases):
    """Every case from 4 threads at once, 5 times each; answers must equal the sequential
    ones exactly (same kernels, same sizes)."""
    model = kwker.load_package(path)
    want = [_flat(model(*args)) for args in cases]
    bad, errors = [], []

    def worker(k):
        try:
            for rep in range(5):
                for i, args in enumerate(cases):
                    got = _flat(model(*args))
                    if not all(torch.equal(a, b) for a, b in zip(got, want[i])):
                        bad.append((k, rep, i))
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors.append(repr(e))
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return want, {"bad": bad, "errors": errors}


def errors(path, cases):
    """Each case is expected to be refused: (exception type, message) per case."""
    model = kwker.load_package(path)
    out = []
    for args in cases:
        try:
            model(*args)
            out.append(None)
        except Exception as e:  # noqa: BLE001 - the test checks the type
            out.append((type(e).__name__, str(e)))
    return out


def load_errors(paths):
    """Each file is expected to be refused at load: (exception type, message) per file."""
    out = []
    for p in paths:
        try:
            kwker.load_package(p)
            out.append(None)
        except Exception as e:  # noqa: BLE001 - the test checks the type
            out.append((type(e).__name__, str(e)))
    return out


def main():
    mode, path, cases_file, out_file = sys.argv[1:5]
    cases = torch.load(cases_file) if cases_file != "-" else []
    from kwker.runtime.kernel import stats
    result = {}
    if mode == "run":
        answers, model = run(path, cases)
        result["kernels"] = model.report.kernel_sizes
        result["missed"] = [m[0] for m in model.report.missed]
        result["families"] = sorted({s.family for s in model.report.specs})
        result["names"] = model.report.kernel_names
        result["aten"] = [n[0] for n in model.report.inner_nodes]
    elif mode == "threads":
        answers, result["threads"] = threads(path, cases)
    elif mode == "errors":
        answers, result["errors"] = None, errors(path, cases)
    else:
        answers, result["load_errors"] = None, load_errors(cases)
    result["seconds"] = time.perf_counter() - t0
    result["dynamo"] = "torch._dynamo" in sys.modules
    result["torchao"] = "torchao" in sys.modules
    result["stats"] = dict(stats)
    torch.save(answers, out_file + ".pt")
    with open(out_file, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
