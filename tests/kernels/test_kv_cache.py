"""``make_kv_append`` against ``torch.cat``: the same values on every path, in place only where
no tensor a caller holds can change."""
import pytest
import torch

from kwker.kernels.kv_cache import capacity, make_kv_append


def _steps(append, past, news, dim):
    """Append each of ``news`` in turn, checking every result against cat."""
    ref = past
    for new in news:
        past, ref = append(past, new), torch.cat([ref, new], dim)
        assert torch.equal(past, ref) and past.dtype == ref.dtype
    return past


@pytest.mark.parametrize("dim", [0, 2, 3])
def test_appends_equal_cat_and_reuse_the_buffer(dim):
    torch.manual_seed(0)
    append = make_kv_append(dim)
    shape = [2, 3, 5, 4]
    shape[dim] = 7
    first = append(torch.empty(0), torch.randn(shape))   # a cache's empty 1-D start
    shape[dim] = 1
    news = [torch.randn(shape) for _ in range(80)]      # grows past one capacity
    ptrs = []
    past = first
    for new in news:
        nxt = _steps(append, past, [new], dim)
        ptrs.append(nxt.data_ptr() == past.data_ptr())
        past = nxt
    # in place until the buffer (capacity(7) rows) is full, then one copy into a larger one
    assert ptrs.count(False) == 1 and ptrs.index(False) == capacity(7) - 7
    others = 2 * 3 * 5 * 4 // [2, 3, 5, 4][dim]
    assert past.untyped_storage().nbytes() == 4 * others * capacity(capacity(7) + 1)


def test_an_older_view_appended_again_leaves_the_newer_one_alone():
    """Beam search or a re-run step: appending to a view that is no longer the latest copies;
    no tensor handed out earlier changes."""
    torch.manual_seed(1)
    append = make_kv_append(2)
    base = append(torch.empty(0), torch.randn(1, 2, 6, 8))
    a, b = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    first = append(base, a)
    first_copy = first.clone()
    second = append(base, b)                  # base is one row behind the buffer now
    assert torch.equal(first, first_copy) and torch.equal(first, torch.cat([base, a], 2))
    assert torch.equal(second, torch.cat([base, b], 2))
    assert second.data_ptr() != first.data_ptr()
    third = append(first, b)                  # first is still its buffer's latest: in place
    assert third.data_ptr() == first.data_ptr() and torch.equal(third, torch.cat([first, b], 2))


def test_cropped_or_offset_views_are_copied():
    torch.manual_seed(2)
    append = make_kv_append(2)
    full = _steps(append, torch.empty(0), [torch.randn(1, 2, 9, 4), torch.randn(1, 2, 1, 4)], 2)
    keep = full.clone()
    for past in (full[:, :, :5], full[:, 1:], full[:, :, 1:]):
        new = torch.randn(1, past.shape[1], 1, 4)
        out = append(past, new)
        assert torch.equal(out, torch.cat([past, new], 2))
        assert torch.equal(full, keep)


def test_dtypes_grad_and_inference_mode_as_cat():
    torch.manual_seed(3)
    append = make_kv_append(1)
    past = append(torch.empty(0), torch.randn(2, 4, 3))
    half = torch.randn(2, 1, 3, dtype=torch.bfloat16)
    out = append(past, half)                  # promotion, as cat does it
    assert out.dtype == torch.float32 and torch.equal(out, torch.cat([past, half], 1))
    leaf = torch.randn(2, 1, 3, requires_grad=True)
    out = append(past, leaf)
    out.sum().backward()
    assert out.requires_grad and torch.equal(leaf.grad, torch.ones_like(leaf))
    with torch.inference_mode():
        inf = append(torch.empty(0), torch.randn(2, 4, 3))
    new = torch.randn(2, 1, 3)
    out = append(inf, new)                    # an inference tensor written outside: copied
    assert torch.equal(out, torch.cat([inf, new], 1)) and not out.is_inference()


def test_a_buffer_appended_along_another_dim_is_copied():
    """Two appends of different dims (each a cache of its own) never write into each other's
    buffers: one grown along dim 2 has no spare room along dim 1."""
    torch.manual_seed(4)
    along2, along1 = make_kv_append(2), make_kv_append(1)
    past = along2(torch.empty(0), torch.randn(1, 3, 5, 4))
    keep = past.clone()
    new = torch.randn(1, 1, 5, 4)
    out = along1(past, new)
    assert torch.equal(out, torch.cat([keep, new], 1)) and torch.equal(past, keep)


def test_bad_shapes_raise_what_cat_raises():
    append = make_kv_append(2)
    past = append(torch.empty(0), torch.randn(1, 2, 4, 8))
    for new in (torch.randn(1, 3, 1, 8), torch.randn(1, 2, 1, 7), torch.randn(2, 8)):
        with pytest.raises(RuntimeError) as ours:
            append(past, new)
        with pytest.raises(RuntimeError) as aten:
            torch.cat([past, new], 2)
        assert str(ours.value) == str(aten.value)
