"""Batched row-major float32 products (mtapply._products.BoundProducts): every op combination
and several shapes in one call against torch.matmul in float64 (a shape of one product, or of
large matrices, left to the caller), alpha and beta, and operands that move between calls (the
address tables are rewritten) or stay (nothing is uploaded)."""
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from mtapply import _products  # noqa: E402


def _op(x, op):
    return x.t() if op == "T" else x


def _terms(generator):
    def rand(*shape):
        return torch.randn(*shape, generator=generator).cuda()

    terms = []
    for op_a, op_b, a_shape, b_shape in [("N", "N", (5, 3), (3, 7)), ("T", "N", (6, 4), (6, 9)),
                                         ("N", "T", (8, 6), (5, 6)), ("T", "T", (3, 2), (4, 3))]:
        for _ in range(3):  # three of each shape: one batched call each
            a, b = rand(*a_shape), rand(*b_shape)
            c = rand(_op(a, op_a).shape[0], _op(b, op_b).shape[1])
            terms.append((op_a, op_b, a, b, c))
    return terms


def _expected(terms, alpha, beta):
    return [alpha * (_op(a.double(), oa) @ _op(b.double(), ob)) + beta * c.double()
            for oa, ob, a, b, c in terms]


def _run(bound, terms, alpha, beta) -> list:
    return bound.run(_products.operand_addresses([t[2:] for t in terms]), alpha=alpha, beta=beta)


def test_batched_products_match_matmul_and_follow_moved_operands():
    generator = torch.Generator().manual_seed(0)
    terms = _terms(generator)
    lone = ("N", "N", torch.randn(5, 3, device="cuda"), torch.randn(3, 2, device="cuda"),
            torch.randn(5, 2, device="cuda"))  # the only product of its shape
    large = ("N", "T", torch.randn(4096, 1025, device="cuda"), torch.randn(2, 1025, device="cuda"),
             torch.randn(4096, 2, device="cuda"))
    before = [lone[4].clone(), large[4].clone()]
    with_others = _products.BoundProducts([lone] + terms + [large, large])
    assert _run(with_others, [lone] + terms + [large, large], 1.0, 0.0) == [
        0, len(terms) + 1, len(terms) + 2]
    assert torch.equal(lone[4], before[0]) and torch.equal(large[4], before[1])
    bound = _products.BoundProducts(terms)
    for alpha, beta in ((1.0, 0.0), (0.5, 0.9)):
        expected = _expected(terms, alpha, beta)
        assert _run(bound, terms, alpha, beta) == []
        for (*_, c), want in zip(terms, expected):
            torch.testing.assert_close(c.double(), want, rtol=1e-4, atol=1e-4)
    # new outputs and inputs for half the terms: the tables follow them
    moved = [(oa, ob, a.clone() if k % 2 else a, b, c.clone() * 2 if k % 2 else c)
             for k, (oa, ob, a, b, c) in enumerate(terms)]
    expected = _expected(moved, 1.0, 1.0)
    assert _run(bound, moved, 1.0, 1.0) == []
    for (*_, c), want in zip(moved, expected):
        torch.testing.assert_close(c.double(), want, rtol=1e-4, atol=1e-4)
    assert len(bound.batches) == 4


def test_only_float32_row_major_gpu_matrices_are_batched():
    x = torch.randn(4, 4, device="cuda")
    assert _products.batchable(x)
    assert not _products.batchable(x.t())  # a transposed view is not row-major
    assert not _products.batchable(x.double()) and not _products.batchable(x.cpu())
    assert not _products.batchable(x.bfloat16())


def test_batched_products_follow_torchs_float32_matmul_precision():
    """At torch's "high" precision the batched products round their inputs to TF32 (errors of
    some 1e-4 against float64, as torch.matmul's own), at "highest" they keep float32; CuPy's
    cuBLAS handle gets its math mode back."""
    import cupy
    from cupy_backends.cuda.libs import cublas

    generator = torch.Generator().manual_seed(3)
    a = [torch.randn(64, 256, generator=generator).cuda() for _ in range(3)]
    b = [torch.randn(256, 32, generator=generator).cuda() for _ in range(3)]
    handle = cupy.cuda.device.get_cublas_handle()
    mode = cublas.getMathMode(handle)
    saved = torch.get_float32_matmul_precision()
    errors = {}
    try:
        for precision in ("high", "highest"):
            torch.set_float32_matmul_precision(precision)
            c = [torch.empty(64, 32, device="cuda") for _ in range(3)]
            terms = [("N", "N", x, y, z) for x, y, z in zip(a, b, c)]
            assert _run(_products.BoundProducts(terms), terms, 1.0, 0.0) == []
            torch.cuda.synchronize()
            errors[precision] = max(((z.double() - x.double() @ y.double()).abs().max()
                                     / (x.double() @ y.double()).abs().max()).item()
                                    for x, y, z in zip(a, b, c))
    finally:
        torch.set_float32_matmul_precision(saved)
    assert 1e-5 < errors["high"] < 1e-2, errors
    assert errors["highest"] < 1e-5, errors
    assert cublas.getMathMode(handle) == mode


def test_bound_products_run_moved_operands_and_leave_the_lone_terms():
    """Terms bound once run again over new operands of the same shapes: the batches follow the
    new addresses; a shape of one term is left to the caller, by its index."""
    generator = torch.Generator().manual_seed(1)
    terms = _terms(generator)
    lone = ("N", "N", torch.randn(5, 3, device="cuda"), torch.randn(3, 2, device="cuda"),
            torch.randn(5, 2, device="cuda"))
    bound = _products.BoundProducts(terms + [lone])
    assert bound.left == [len(terms)] and len(bound.batches) == 4
    for step in range(3):
        moved = [(oa, ob, a + step, b.clone(), torch.full_like(c, float("nan")))
                 for oa, ob, a, b, c in terms]
        # beta 0: the NaNs in c are not read
        expected = _expected([(*t[:4], torch.zeros_like(t[4])) for t in moved], 0.5, 0.0)
        assert _run(bound, moved + [lone], 0.5, 0.0) == [len(terms)]
        for (*_, c), want in zip(moved, expected):
            torch.testing.assert_close(c.double(), want, rtol=1e-4, atol=1e-4)
