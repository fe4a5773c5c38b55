"""The training bench's bookkeeping on the CPU: rounds, medians, ratios and the loss after the run
(the models themselves need a GPU)."""
from mtapply.bench import train


class _FakeRun:
    """A variant whose loss falls by `rate` a step; the harness's calls are counted."""

    def __init__(self, rate):
        self.rate, self.steps, self.loss = rate, 0, 1.0

    def step(self):
        self.steps += 1
        self.loss *= 1.0 - self.rate

    def sync(self):
        pass

    def final_loss(self):
        return self.loss


def test_each_variant_takes_the_same_steps_and_reports_its_loss_against_the_reference():
    made = {}

    def factory(name, rate):
        def make():
            made[name] = _FakeRun(rate)
            return made[name]
        return make

    model = train.Model("toy", "a toy", "float", {"float": factory("float", 0.01),
                                                   "eight": factory("eight", 0.011)})
    rows = train.run_model(model, rounds=3, steps=4, warmup=2)
    assert [r["variant"] for r in rows] == ["float", "eight"]
    assert made["float"].steps == made["eight"].steps == 2 + 3 * 4
    for row in rows:
        assert row["steps"] == 14 and len(row["samples_ms"]) == 3
        assert row["final_loss"] == made[row["variant"]].loss
    assert rows[0]["loss_vs_reference"] == 0.0 and rows[0]["ratio"] == 1.0
    want = made["eight"].loss / made["float"].loss - 1
    assert abs(rows[1]["loss_vs_reference"] - want) < 1e-15 and want < 0
    table = train.format_table(rows)
    assert f"{made['eight'].loss:.4f} ({want:+.2%})" in table


def test_a_variant_without_a_loss_and_a_skipped_model_print_as_such():
    rows = [{"model": "m", "variant": "v", "ms_per_step": 1.0, "ratio": 1.0, "samples_ms": [1.0],
             "final_loss": None, "loss_vs_reference": None},
            {"model": "n", "error": "ImportError: no transformers"}]
    lines = train.format_table(rows).splitlines()
    assert lines[2].endswith("| - |") and "skipped: ImportError" in lines[3]
    assert all(line.count("|") == 7 for line in lines)


def test_the_lion_model_is_listed_with_float_lion_as_reference():
    assert "gpt2-lion8bit" in train.MODELS
    names = train.lion_optimizers(1e-4, 0.1)
    assert {"mtapply-lion", "mtapply-lion8bit"} <= set(names)


def test_markov_batches_are_fixed_walks_over_a_small_vocabulary():
    import torch

    batches = train.markov_batches(3, 2, 40, "cpu", vocab=16)
    assert batches.shape == (3, 2, 40) and batches.dtype == torch.int64
    assert batches.min() >= 0 and batches.max() < 50257
    assert len(torch.unique(batches)) <= 16
    assert torch.equal(batches, train.markov_batches(3, 2, 40, "cpu", vocab=16))
    assert not torch.equal(batches[0], batches[1])  # a fresh batch each step
    pairs = set(zip(batches[..., :-1].flatten().tolist(), batches[..., 1:].flatten().tolist()))
    followers: dict = {}
    for first, second in pairs:
        followers.setdefault(first, set()).add(second)
    assert max(len(f) for f in followers.values()) <= train.MARKOV_SUCCESSORS
    assert len(pairs) > 16  # a walk, not one fixed cycle


def test_each_model_reads_the_stream_from_its_own_start(monkeypatch):
    import torch

    monkeypatch.setattr(train, "markov_batches",
                        lambda count, batch, tokens, device: torch.arange(count).reshape(count, 1, 1)
                        .expand(count, batch, tokens))
    seen = []

    class Model:
        def __call__(self, input_ids, labels):
            seen.append((id(self), int(input_ids[0, 0])))
            return type("Out", (), {"loss": 0.0})()

    loss = train.markov_loss(2, 4, pool=3)
    a, b = Model(), Model()
    for model in (a, b, b, a, a, a):
        loss(model)
    assert [k for m, k in seen if m == id(a)] == [0, 1, 2, 0]
    assert [k for m, k in seen if m == id(b)] == [0, 1]
