"""The CPU benchmark's rows run and report (a few steps of small lists), and mtapply's rows
step their params as torch.optim does."""
import pytest

torch = pytest.importorskip("torch")

from mtapply.bench import cpu  # noqa: E402


def test_cpu_bench_times_every_row_briefly(capsys):
    rows = cpu.measure(torch, cases=[(3, (8, 8)), (5, (3,))], steps=2, rounds=2, warmup=1)
    names = set(cpu.competitors(torch))
    assert {name for _, name, _, _ in rows} == names
    assert len(rows) == 2 * len(names) and all(ms > 0 for *_, ms in rows)
    text = cpu.format_rows(rows)
    assert "mtapply AdamW8bit" in text and "x torch AdamW foreach" in text
    cpu.main(["--steps", "1", "--rounds", "1", "--cases", "1000x32", "--rows", "mtapply SGD",
              "torch SGD foreach"])
    assert "mtapply SGD" in capsys.readouterr().out


@pytest.mark.parametrize("pair", [("mtapply AdamW", "torch AdamW foreach"),
                                  ("mtapply SGD", "torch SGD forloop")])
def test_cpu_bench_rows_step_alike(pair):
    table = cpu.competitors(torch)
    results = []
    for name in pair:
        params = cpu._params(torch, 4, (5, 7), seed=1) + cpu._params(torch, 2, (300,), seed=2)
        step = table[name][1](params)
        for _ in range(3):
            step()
        results.append([p.detach().clone() for p in params])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
