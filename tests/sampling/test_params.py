

def test_argmax_ids_is_torchs_argmax_ties_included():
    """The greedy choice through numpy (torch's CPU argmax is not vectorised) picks what torch's
    would: the first maximum on ties, every row, any layout; other dtypes go through torch."""
    import torch

    from specbuild.sampling.params import argmax_ids

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 49152, generator=g)
    x[1, 7] = x[1, 9000] = x[1].max() + 1  # a tie: the lower id wins
    x[3] = 0.0  # all equal: id 0
    assert argmax_ids(x) == x.argmax(-1).tolist() and argmax_ids(x)[1] == 7 and argmax_ids(x)[3] == 0
    assert argmax_ids(x[2]) == [int(x[2].argmax())]
    assert argmax_ids(x.t().contiguous().t()) == x.argmax(-1).tolist()  # a strided view
    assert argmax_ids(x.double()) == x.argmax(-1).tolist()
    b = x.to(torch.bfloat16)
    assert argmax_ids(b) == b.argmax(-1).tolist()
