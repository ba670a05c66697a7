"""The drop-in contract: scoping, every call path, errors, autograd, threads, version guard."""
import threading
import warnings

import pytest
import torch

import kwker.torch_ops as kto
from kwker.ops import rows

from .inputs import assert_identical, make
from .test_sort_topk import check


def test_accelerated_is_scoped_nestable_and_exception_safe():
    assert not kto.is_active()
    with kto.accelerated():
        assert kto.is_active()
        with kto.accelerated():
            assert kto.is_active()
        assert kto.is_active()
    assert not kto.is_active()
    with pytest.raises(ZeroDivisionError):
        with kto.accelerated():
            1 / 0
    assert not kto.is_active()


def test_install_uninstall_idempotent():
    try:
        kto.install()
        kto.install()
        assert kto.is_active()
        with kto.accelerated():
            pass
        assert kto.is_active()
    finally:
        kto.uninstall()
        kto.uninstall()
    assert not kto.is_active()


def test_every_call_path_reaches_kwker():
    x = make("ties4", (4, 5000), torch.float32)
    want = torch.topk(x, 5)
    before = rows.calls["topk"]
    with kto.accelerated():
        outs = [torch.topk(x, 5), x.topk(5), torch.ops.aten.topk.default(x, 5),
                torch.ops.aten.topk(x, 5)]
        v, i = torch.empty(0), torch.empty(0, dtype=torch.long)
        torch.topk(x, 5, out=(v, i))
        outs.append((v, i))
    assert rows.calls["topk"] - before == len(outs)
    for got in outs:
        assert_identical(tuple(got), tuple(want))



@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("op", ["kthvalue", "median", "nanmedian"])
def test_reductions_write_their_out_tensors_as_aten(op, keepdim):
    """out= of the index reductions: empty outs (as the functional forms' wrapper passes them,
    written by the kernel in place), outs of the wrong size (resized, with ATen's warning) and
    strided outs of the right size (written through their strides), each identical to ATen's,
    the outs themselves returned."""
    x = make("ties4", (12, 3000), torch.float32).t()     # rows along dim 0, strided
    args = (1500, 0) if op == "kthvalue" else (0,)
    fn = getattr(torch, op)

    def outs(kind):
        if kind == "empty":
            return torch.empty(0), torch.empty(0, dtype=torch.long)
        if kind == "wrong size":
            return torch.zeros(7), torch.zeros(7, dtype=torch.long)
        shape = (1, 12) if keepdim else (12,)
        return (torch.zeros(*shape, 2)[..., 1], torch.zeros(*shape, 2, dtype=torch.long)[..., 1])

    for kind in ("empty", "wrong size", "strided"):
        want_v, want_i = outs(kind)
        with warnings.catch_warnings(record=True) as aten_warned:
            warnings.simplefilter("always")
            fn(x, *args, keepdim=keepdim, out=(want_v, want_i))
        got_v, got_i = outs(kind)
        before = rows.calls[op]
        with kto.accelerated(), warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            result = fn(x, *args, keepdim=keepdim, out=(got_v, got_i))
        assert rows.calls[op] == before + 1, kind
        assert result[0] is got_v and result[1] is got_i, kind
        assert_identical((got_v, got_i), (want_v, want_i))
        assert got_v.stride() == want_v.stride() and got_i.stride() == want_i.stride(), kind
        assert len(warned) == len(aten_warned), (kind, [str(w.message) for w in warned])

ERROR_CASES = [
    lambda x: torch.topk(x, 501),
    lambda x: torch.topk(x, -1),
    lambda x: torch.topk(x, 2, dim=5),
    lambda x: torch.sort(x, dim=-3),
    lambda x: torch.kthvalue(x, 0),
    lambda x: torch.kthvalue(x, 501),
    lambda x: torch.median(x, dim=2),
    lambda x: torch.mode(x, dim=7),
    lambda x: torch.quantile(x, 1.5),
    lambda x: torch.quantile(x, torch.tensor([0.5], dtype=torch.float64)),
    lambda x: torch.quantile(x, torch.tensor([[0.5]])),
    lambda x: torch.quantile(x, 0.5, interpolation="cubic"),
    lambda x: torch.quantile(x.long(), 0.5),
    lambda x: torch.topk(x.bool(), 2),
    lambda x: torch.nanquantile(x, torch.tensor([0.1, float("nan")])),
    lambda x: torch.kthvalue(torch.empty(0), 1),
    lambda x: torch.median(torch.empty(0), 0),
]


@pytest.mark.parametrize("case", range(len(ERROR_CASES)))
def test_errors_match_aten(case):
    x = make("normal", (4, 500), torch.float32)
    fn = ERROR_CASES[case]
    with pytest.raises(Exception) as aten_err:
        fn(x)
    with kto.accelerated():
        with pytest.raises(Exception) as kw_err:
            fn(x)
    assert type(kw_err.value) is type(aten_err.value)
    assert str(kw_err.value) == str(aten_err.value)


def test_edge_shapes_match_aten():
    cases = [torch.tensor(2.5), torch.empty(0), torch.empty(3, 0), torch.empty(0, 3),
             torch.randn(1), torch.randn(5, 1)]
    for x in cases:
        fns = [lambda: torch.sort(x), lambda: torch.topk(x, 0 if x.dim() == 0 else min(
            1, x.shape[-1])), lambda: torch.median(x), lambda: torch.nanmedian(x)]
        if x.numel():
            fns += [lambda: torch.kthvalue(x, 1), lambda: torch.mode(x),
                    lambda: torch.quantile(x, 0.5), lambda: torch.median(x, -1)]
        for fn in fns:
            check(fn, f"edge shape {tuple(x.shape)}")


def test_unsupported_dtypes_route_to_aten():
    x = torch.randint(0, 2, (4, 3000), dtype=torch.bool)
    before = sum(rows.calls.values())
    want = torch.sort(x), torch.mode(x, 1)
    with kto.accelerated():
        got = torch.sort(x), torch.mode(x, 1)
    assert sum(rows.calls.values()) == before
    for g, w in zip(got, want):
        assert_identical(tuple(g), tuple(w))


def test_autograd_gradients_match():
    x0 = make("ties4", (6, 200), torch.float64) + torch.randn(6, 200, dtype=torch.float64) * 0.1

    def grads():
        x = x0.clone().requires_grad_(True)
        loss = (torch.topk(x, 3).values.sum() + torch.sort(x, dim=1, stable=True).values[:, :7].sum()
                + torch.kthvalue(x, 50).values.sum() + torch.median(x, 0).values.sum()
                + torch.nanmedian(x) + torch.mode(x.round(), 1).values.sum()
                + torch.quantile(x, torch.tensor([0.2, 0.9], dtype=x.dtype), dim=1).sum()
                + torch.nanquantile(x, 0.3, interpolation="midpoint"))
        loss.backward()
        return x.grad
    want = grads()
    with kto.accelerated():
        got = grads()
    assert_identical(got, want)


def test_threads_give_correct_results():
    xs = [make(p, (8, 3000), torch.float32, seed=s) for s, p in
          enumerate(["normal", "ties4", "ties_nan", "signed_zero"] * 2)]
    wants = [(torch.sort(x), torch.topk(x, 9), torch.quantile(x, 0.3, dim=1)) for x in xs]
    errors = []

    def work(i):
        try:
            for _ in range(5):
                got = (torch.sort(xs[i]), torch.topk(xs[i], 9), torch.quantile(xs[i], 0.3, 1))
                for g, w in zip(got, wants[i]):
                    assert_identical(g if isinstance(g, tuple) else (g,),
                                     w if isinstance(w, tuple) else (w,))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    with kto.accelerated():
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[0]


def test_follows_torch_num_threads():
    x = make("normal", (64, 4000), torch.float32)
    want = torch.sort(x)
    with kto.accelerated():
        for n in (1, 2):
            torch.set_num_threads(n)
            assert_identical(tuple(torch.sort(x)), tuple(want))


def test_unverified_torch_release_routes_to_aten(monkeypatch):
    monkeypatch.setattr(kto, "VERIFIED_TORCH", ("0.0.0",))
    monkeypatch.setattr(kto._State, "warned", False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with kto.accelerated():
            assert not kto.is_active()
        with kto.accelerated():
            pass
    assert sum("verified" in str(m.message) for m in w) == 1
