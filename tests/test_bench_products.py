"""The Newton-Schulz products benchmark (mtapply.bench.products) on the CPU: its shape groups,
its FLOP counts, and the products it times are one iteration of mtapply.torch.Muon's."""
import pytest

torch = pytest.importorskip("torch")

from mtapply.bench import products  # noqa: E402


def test_groups_and_flops_follow_the_short_and_long_sides():
    assert products.shape_groups([(4, 8), (8, 4), (4, 8), (3, 3)]) == {(4, 8): 2, (8, 4): 1, (3, 3): 1}
    for rows, cols in ((4, 8), (8, 4)):  # a tall batch iterates on its transpose
        assert products.product_flops("gram", 5, rows, cols) == 2 * 5 * 4 * 4 * 8
        assert products.product_flops("gram_polynomial", 5, rows, cols) == 2 * 5 * 4 ** 3
        assert products.product_flops("x_update", 5, rows, cols) == 2 * 5 * 4 * 4 * 8


def test_rows_time_each_product_of_each_shape():
    shapes = [(8, 24)] * 3 + [(24, 8)] * 2 + [(16, 16)]
    rows = products.product_rows(shapes, torch.device("cpu"), repeats=2, steps=2)
    assert [(r["product"], r["shape"]) for r in rows] == [
        (p, s) for s in ([3, 8, 24], [2, 24, 8], [1, 16, 16]) for p in products.PRODUCTS]
    for row in rows:
        assert row["seconds"] > 0
        flops = products.product_flops(row["product"], *row["shape"])
        assert row["tflops"] * row["seconds"] * 1e12 == pytest.approx(flops)


@pytest.mark.parametrize("shape", [(8, 24), (24, 8)])
def test_the_timed_products_make_one_newton_schulz_iteration(shape):
    torch.manual_seed(0)
    batch = products._batch(3, *shape, torch.device("cpu"))
    x = batch.updates.double()
    calls = products._calls(batch)
    for name in products.PRODUCTS:
        calls[name]()
    a, b, c = products.COEFFICIENTS
    if shape[0] <= shape[1]:
        gram = x @ x.mT
        expected = a * x + (b * gram + c * gram @ gram) @ x
    else:
        gram = x.mT @ x
        expected = a * x + x @ (b * gram + c * gram @ gram)
    error = (batch.other.double() - expected).norm() / expected.norm()
    assert error < 2e-2  # bfloat16 products
    assert not torch.equal(batch.other, batch.updates)


def test_joined_rows_batch_every_gram_matrix_of_a_shared_side():
    shapes = [(8, 24)] * 3 + [(24, 8)] * 2 + [(8, 16)] + [(16, 16)]
    rows = products.joined_rows(shapes, torch.device("cpu"), repeats=1, steps=1)
    assert [(r["product"], r["shape"]) for r in rows] == [("gram_polynomial (joined)", [6, 8, 8])]
    assert rows[0]["tflops"] * rows[0]["seconds"] * 1e12 == pytest.approx(2 * 6 * 8 ** 3)
