"""python -m mtapply.bench.train: whole training steps of real models, mtapply against the peer.

Each model is trained with each of its variants (the same initial weights and data, one copy
per variant, all in one process): forward, backward and the optimizer step, as a training loop
runs them. The variants take turns in rounds, in one order and then the reverse (A B C, C B A,
...), so that drift of the host or the GPU hits them alike; each round times a run of steps
between two synchronisations, and the table gives the median of the rounds as ms per step and
as a ratio to the model's reference variant (torch's fused optimizer; optax in JAX). Each
variant takes the same steps on the same batches, so a torch model's rows also give the loss
after the run, against the reference's.

- gpt2: GPT-2 124M from a `transformers` config, AdamW, bf16 autocast, batch 8 x 512 tokens;
- gpt2-groups: the same with a param group per tensor (layer-wise lr decay, no weight decay on
  1-D params) and a scheduler setting every group's lr each step;
- gpt2-muon: the same model with the usual hybrid, Muon for the blocks' matrices and AdamW for
  the rest: torch.optim.Muon + fused AdamW against mtapply.torch.Muon's one optimizer;
- gpt2-lion8bit: the same model with Lion, its moment in 8 bits (mtapply.torch.Lion with
  state_bits=8, and bitsandbytes' Lion8bit where installed) against float Lion, on a fresh
  batch each step from a fixed Markov chain (`markov_batches`);
- resnet50: torchvision's ResNet-50, SGD with momentum and LARS, bf16 autocast, batch 32;
- mlp: a deep narrow MLP (600 layers of 256, 1,200 small params), AdamW, fp32;
- jax-mlp: an MLP in JAX (flax if installed, else plain JAX), optax.adamw against
  mtapply.optax.adamw and fused_adamw, each step one jitted function with donation.

Needs a CUDA GPU and torch; transformers, torchvision and jax for their models (a model whose
library is missing is skipped with a note). Writes JSON and, with matplotlib, a PNG plot.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

from .common import import_jax


@dataclass
class Model:
    """A model, its variants (name -> factory of a runner) and the variant ratios divide by."""

    name: str
    description: str
    reference: str
    variants: dict = field(default_factory=dict)


class _TorchRun:
    """One variant of a torch model: its own copy of the model and its optimizer."""

    def __init__(self, model, optimizer, loss, autocast: bool, schedule=None):
        self.model, self.optimizer, self.loss, self.autocast = model, optimizer, loss, autocast
        self.scheduler = None
        self.last_loss = None  # a device tensor: read once, after the run
        if schedule is not None:
            import torch

            self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    def step(self) -> None:
        import torch

        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.loss(self.model)
        loss.backward()
        self.last_loss = loss.detach()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def sync(self) -> None:
        import torch

        torch.cuda.synchronize()

    def final_loss(self) -> float | None:
        return None if self.last_loss is None else float(self.last_loss)


class _JaxRun:
    """One variant of a JAX model: params, optimizer state and a jitted, donating step."""

    def __init__(self, step, params, state, batch):
        self._step, self.params, self.state, self.batch = step, params, state, batch

    def step(self) -> None:
        self.params, self.state = self._step(self.params, self.state, *self.batch)

    def sync(self) -> None:
        import jax

        jax.block_until_ready((self.params, self.state))

    def final_loss(self) -> None:  # the jitted step returns no loss
        return None


def time_steps(run, steps: int) -> float:
    """Wall ms per step over `steps` steps between two synchronisations."""
    run.sync()
    start = time.perf_counter()
    for _ in range(steps):
        run.step()
    run.sync()
    return (time.perf_counter() - start) * 1e3 / steps


def interleaved(runs: dict, rounds: int, steps: int) -> dict:
    """name -> ms per step of each round; round r runs the variants in order, r + 1 reversed."""
    names = list(runs)
    samples = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            samples[name].append(time_steps(runs[name], steps))
    return samples


# ---------------------------------------------------------------------------------------------
# torch models


def _torch_variants(optimizers: dict, build, loss, autocast: bool = True, schedule=None) -> dict:
    """name -> factory of a _TorchRun with its own deep copy of the model `build()` gives."""

    def factory(make_optimizer, base):
        model = copy.deepcopy(base).cuda()
        return _TorchRun(model, make_optimizer(model), loss, autocast, schedule)

    base = build()
    return {name: functools.partial(factory, make, base) for name, make in optimizers.items()}


def _adamw_optimizers(lr: float, weight_decay: float, groups=None) -> dict:
    """AdamW of torch and mtapply over `groups(model)` (default: the model's parameters)."""
    import torch

    import mtapply.torch as mt

    groups = groups or (lambda model: model.parameters())

    return {
        "torch-fused": lambda m: torch.optim.AdamW(groups(m), lr, weight_decay=weight_decay,
                                                   fused=True),
        "mtapply": lambda m: mt.AdamW(groups(m), lr, weight_decay=weight_decay),
        "mtapply-flat-grads": lambda m: mt.AdamW(groups(m), lr, weight_decay=weight_decay,
                                                 flat_grads=True),
        "torch-foreach": lambda m: torch.optim.AdamW(groups(m), lr, weight_decay=weight_decay,
                                                     foreach=True),
    }


def _gpt2(batch: int, tokens: int):
    """GPT-2 124M's builder and loss on a fixed batch of token ids."""
    import torch
    import transformers

    def build():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config())

    ids = torch.randint(0, 50257, (batch, tokens), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))

    def loss(model):
        return model(input_ids=ids, labels=ids).loss

    return build, loss


def gpt2(batch: int = 8, tokens: int = 512) -> Model:
    build, loss = _gpt2(batch, tokens)
    optimizers = {**_adamw_optimizers(3e-4, 0.1), **eight_bit_optimizers(3e-4, 0.1)}
    return Model("gpt2", f"GPT-2 124M (transformers config), AdamW, bf16 autocast, batch "
                         f"{batch} x {tokens}", "torch-fused",
                 _torch_variants(optimizers, build, loss))


def gpt2_groups(batch: int = 8, tokens: int = 512) -> Model:
    build, loss = _gpt2(batch, tokens)
    optimizers = _adamw_optimizers(3e-4, 0.1, groups=_layerwise_groups)
    return Model("gpt2-groups", f"GPT-2 124M, AdamW with a group per tensor (layer-wise lr "
                                f"decay 0.9) and LambdaLR, bf16 autocast, batch {batch} x {tokens}",
                 "torch-fused",
                 _torch_variants(optimizers, build, loss, schedule=lambda t: 1.0 / (1 + t / 100)))


def gpt2_muon(batch: int = 8, tokens: int = 512) -> Model:
    build, loss = _gpt2(batch, tokens)
    return Model("gpt2-muon", f"GPT-2 124M, Muon (lr 0.02) for the blocks' 48 matrices and AdamW "
                              f"(lr 3e-4) for the rest, bf16 autocast, batch {batch} x {tokens}",
                 "torch", _torch_variants(_muon_optimizers(), build, loss))


def gpt2_lion8bit(batch: int = 8, tokens: int = 512) -> Model:
    build, _ = _gpt2(batch, tokens)
    return Model("gpt2-lion8bit", f"GPT-2 124M, Lion (lr 1e-4, betas 0.9/0.99, weight decay 0.1) "
                                  f"with its moment in 8 bits and in float32, bf16 autocast, "
                                  f"batch {batch} x {tokens}, a fresh batch each step from a "
                                  f"fixed Markov chain over {MARKOV_VOCAB} tokens ({MARKOV_SUCCESSORS} "
                                  f"successors each)", "mtapply-lion",
                 _torch_variants(lion_optimizers(1e-4, 0.1), build, markov_loss(batch, tokens)))


MARKOV_VOCAB = 512  # tokens of the chain (ids spread over GPT-2's 50,257)
MARKOV_SUCCESSORS = 4  # the tokens each token may be followed by


def markov_batches(count: int, batch: int, tokens: int, device: str, seed: int = 3,
                   vocab: int = MARKOV_VOCAB, successors: int = MARKOV_SUCCESSORS):
    """`count` batches of token ids, each row a walk of a fixed Markov chain over `vocab` of
    GPT-2's ids, each token followed by one of `successors` others (random weights): a stream
    whose loss falls within a few hundred steps from ln(vocab) toward the chain's entropy (some
    1.1 nats by default), unlike uniform random ids, and unlike one batch seen again, one a
    model cannot memorise."""
    import torch

    gen = torch.Generator(device).manual_seed(seed)
    ids = torch.randperm(50257, generator=gen, device=device)[:vocab]
    following = torch.stack([torch.randperm(vocab, generator=gen, device=device)[:successors]
                             for _ in range(vocab)])
    weights = torch.softmax(torch.randn(vocab, successors, generator=gen, device=device), 1)
    transitions = torch.zeros(vocab, vocab, device=device).scatter_(1, following, weights)
    state = torch.randint(0, vocab, (count * batch,), generator=gen, device=device)
    walk = [state]
    for _ in range(tokens - 1):
        state = torch.multinomial(transitions[state], 1, generator=gen).squeeze(1)
        walk.append(state)
    return ids[torch.stack(walk, 1)].reshape(count, batch, tokens)


def markov_loss(batch: int, tokens: int, pool: int = 256):
    """A loss whose k-th call for a model reads batch k (mod `pool`) of `markov_batches`: each
    variant, however the rounds interleave them, sees the same batches in the same order, each
    one once in runs of up to `pool` steps (the defaults take 75)."""
    batches = markov_batches(pool, batch, tokens, "cuda")
    calls: dict = {}

    def loss(model):
        k = calls[id(model)] = calls.get(id(model), -1) + 1
        ids = batches[k % pool]
        return model(input_ids=ids, labels=ids).loss

    return loss


def lion_optimizers(lr: float, weight_decay: float) -> dict:
    """Lion with a float32 moment (mtapply's, the reference), with an 8-bit one (mtapply's) and
    bitsandbytes' Lion8bit where installed."""
    import importlib.util

    import mtapply.torch as mt

    hyper = dict(lr=lr, betas=(0.9, 0.99), weight_decay=weight_decay)
    made = {"mtapply-lion": lambda m: mt.Lion(m.parameters(), **hyper),
            "mtapply-lion8bit": lambda m: mt.Lion(m.parameters(), state_bits=8, **hyper)}
    if importlib.util.find_spec("bitsandbytes"):
        def bitsandbytes(m):
            import bitsandbytes as bnb

            return bnb.optim.Lion8bit(m.parameters(), **hyper)
        made["bnb-lion8bit"] = bitsandbytes
    return made


class _Optimizers:
    """Several optimizers stepped as one (torch.optim.Muon takes matrices only)."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


def _muon_optimizers() -> dict:
    import torch

    import mtapply.torch as mt

    def split(model):
        named = list(model.named_parameters())
        hidden = [p for name, p in named if p.dim() == 2 and ".h." in name]
        chosen = set(map(id, hidden))
        return hidden, [p for _, p in named if id(p) not in chosen]

    adamw = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def torch_pair(model):
        hidden, others = split(model)
        return _Optimizers(torch.optim.Muon(hidden, lr=0.02),
                           torch.optim.AdamW(others, **adamw, fused=True))

    def mtapply_one(model):
        hidden, others = split(model)
        return mt.Muon([{"params": hidden}, {"params": others, "use_muon": False, **adamw}],
                       lr=0.02)

    return {"torch": torch_pair, "mtapply": mtapply_one}


def _layerwise_groups(model, decay: float = 0.9, weight_decay: float = 0.1) -> list:
    """One group per tensor: lr scaled by decay ** (layers above), no weight decay on 1-D."""
    depth = model.config.n_layer + 1
    groups = []
    for name, p in model.named_parameters():
        layer = int(name.split(".h.")[1].split(".")[0]) + 1 if ".h." in name else (
            0 if ".wte" in name or ".wpe" in name else depth)
        groups.append({"params": [p], "lr": 3e-4 * decay ** (depth - layer),
                       "weight_decay": 0.0 if p.dim() == 1 else weight_decay})
    return groups


def eight_bit_optimizers(lr: float, weight_decay: float) -> dict:
    """AdamW with 8-bit moments: mtapply's, and bitsandbytes' and torchao's where installed."""
    import importlib.util

    import mtapply.torch as mt

    made = {"mtapply-8bit": lambda m: mt.AdamW8bit(m.parameters(), lr, weight_decay=weight_decay)}
    if importlib.util.find_spec("bitsandbytes"):
        def bitsandbytes(m):
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(m.parameters(), lr, weight_decay=weight_decay)
        made["bnb-8bit"] = bitsandbytes
    if importlib.util.find_spec("torchao"):
        def torchao(m):
            from torchao.optim import AdamW8bit

            return AdamW8bit(m.parameters(), lr, weight_decay=weight_decay)
        made["torchao-8bit"] = torchao
    return made


def resnet50(batch: int = 32) -> Model:
    import torch
    import torchvision

    import mtapply.torch as mt

    def build():
        torch.manual_seed(0)
        return torchvision.models.resnet50()

    generator = torch.Generator("cuda").manual_seed(1)
    images = torch.randn(batch, 3, 224, 224, device="cuda", generator=generator)
    labels = torch.randint(0, 1000, (batch,), device="cuda", generator=generator)

    def loss(model):
        return torch.nn.functional.cross_entropy(model(images), labels)

    def lars(model):
        weights = [p for p in model.parameters() if p.ndim > 1]
        others = [p for p in model.parameters() if p.ndim <= 1]
        return mt.LARS([{"params": weights}, {"params": others, "exclude": True}], lr=0.1,
                       momentum=0.9, weight_decay=1e-4, trust_coefficient=0.001)

    sgd = dict(lr=0.1, momentum=0.9, weight_decay=1e-4)
    optimizers = {
        "torch-fused": lambda m: torch.optim.SGD(m.parameters(), fused=True, **sgd),
        "mtapply": lambda m: mt.SGD(m.parameters(), **sgd),
        "mtapply-lars": lars,
        "torch-foreach": lambda m: torch.optim.SGD(m.parameters(), foreach=True, **sgd),
    }
    return Model("resnet50", f"ResNet-50 (torchvision), SGD momentum 0.9 and LARS, bf16 "
                             f"autocast, batch {batch}", "torch-fused",
                 _torch_variants(optimizers, build, loss))


def mlp(depth: int = 600, width: int = 256, batch: int = 512) -> Model:
    import torch

    def build():
        torch.manual_seed(0)
        layers = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers)

    generator = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(batch, width, device="cuda", generator=generator)
    y = torch.randn(batch, width, device="cuda", generator=generator)

    def loss(model):
        return torch.nn.functional.mse_loss(model(x), y)

    return Model("mlp", f"MLP of {depth} layers of {width} ({2 * depth} params), AdamW, fp32, "
                        f"batch {batch}", "torch-fused",
                 _torch_variants(_adamw_optimizers(1e-4, 0.01), build, loss, autocast=False))


# ---------------------------------------------------------------------------------------------
# JAX model


def jax_mlp(depth: int = 48, width: int = 1024, batch: int = 256) -> Model:
    jax, optax = import_jax()
    import jax.numpy as jnp

    import mtapply.optax as mtx

    apply, params, library = _jax_mlp(jax, depth, width, batch)
    keys = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(keys[0], (batch, width))
    y = jax.random.normal(keys[1], (batch, width))

    def loss(p, x, y):
        return jnp.mean((apply(p, x) - y) ** 2)

    def transformation(tx):
        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(p, state, x, y):
            updates, state = tx.update(jax.grad(loss)(p, x, y), state, p)
            return optax.apply_updates(p, updates), state

        return lambda: _JaxRun(step, jax.tree.map(jnp.copy, params), tx.init(params), (x, y))

    def fused(opt):
        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(p, state, x, y):
            return opt.step(p, jax.grad(loss)(p, x, y), state)

        return lambda: _JaxRun(step, jax.tree.map(jnp.copy, params), opt.init(params), (x, y))

    hyper = dict(weight_decay=0.01)
    variants = {"optax": transformation(optax.adamw(1e-4, **hyper)),
                "mtapply-optax": transformation(mtx.adamw(1e-4, **hyper)),
                "mtapply-optax-fused": fused(mtx.fused_adamw(1e-4, **hyper))}
    return Model("jax-mlp", f"MLP in JAX ({library}) of {depth} layers of {width}, AdamW, "
                            f"batch {batch}, fp32, jitted step with donation", "optax", variants)


def _jax_mlp(jax, depth: int, width: int, batch: int):
    """(apply, params, library): flax.linen's Dense layers if flax imports, else plain JAX."""
    import jax.numpy as jnp

    try:
        import flax.linen as nn
    except ImportError:
        nn = None
    if nn is not None:
        model = nn.Sequential([layer for _ in range(depth) for layer in (nn.Dense(width), nn.relu)])
        params = model.init(jax.random.PRNGKey(0), jnp.zeros((batch, width)))
        return model.apply, params, "flax.linen"
    keys = jax.random.split(jax.random.PRNGKey(0), depth)
    params = [{"w": jax.random.normal(k, (width, width)) / width ** 0.5, "b": jnp.zeros(width)}
              for k in keys]

    def apply(p, x):
        for layer in p:
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        return x

    return apply, params, "plain JAX"


MODELS = {"gpt2": gpt2, "gpt2-groups": gpt2_groups, "gpt2-muon": gpt2_muon,
          "gpt2-lion8bit": gpt2_lion8bit, "resnet50": resnet50, "mlp": mlp, "jax-mlp": jax_mlp}


# ---------------------------------------------------------------------------------------------
# Running and reporting


def run_model(model: Model, rounds: int, steps: int, warmup: int) -> list:
    """Rows of one model: median ms per step of each variant and the ratio to the reference."""
    runs = {}
    for name, factory in model.variants.items():
        runs[name] = factory()
        for _ in range(warmup):  # compiles, builds plans, fills allocator caches
            runs[name].step()
        runs[name].sync()
        _progress(f"  {model.name} {name}: ready")
    samples = interleaved(runs, rounds, steps)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    reference = medians[model.reference]
    losses = {name: run.final_loss() for name, run in runs.items()}
    return [{"model": model.name, "description": model.description, "variant": name,
             "ms_per_step": medians[name], "ratio": medians[name] / reference,
             "samples_ms": samples[name], "reference": model.reference,
             "steps": warmup + rounds * steps, "final_loss": losses[name],
             "loss_vs_reference": _relative(losses[name], losses[model.reference])}
            for name in runs]


def _relative(loss, reference):
    """loss / reference - 1, or None where either is unknown."""
    return None if loss is None or not reference else loss / reference - 1.0


def format_table(rows: list) -> str:
    lines = ["| model | variant | ms per step (median) | x reference | rounds (ms) | loss after "
             "the run (vs reference) |", "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | | skipped: {row['error']} | | | |")
            continue
        spread = f"{min(row['samples_ms']):.2f}-{max(row['samples_ms']):.2f}"
        loss = "-" if row.get("final_loss") is None else (
            f"{row['final_loss']:.4f} ({row['loss_vs_reference']:+.2%})")
        lines.append(f"| {row['model']} | {row['variant']} | {row['ms_per_step']:.2f} | "
                     f"{row['ratio']:.3f} | {spread} | {loss} |")
    return "\n".join(lines)


def plot(rows: list, path: str) -> bool:
    """A bar per variant of each model, its time over the model's reference; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    timed = [row for row in rows if "error" not in row]
    labels = [f"{row['model']}: {row['variant']}" for row in timed]
    figure, axes = plt.subplots(figsize=(8, 0.4 * len(timed) + 1.5))
    axes.barh(range(len(timed)), [row["ratio"] for row in timed],
              color=["tab:blue" if row["variant"].startswith("mtapply") else "tab:gray"
                     for row in timed])
    axes.set_yticks(range(len(timed)), labels)
    axes.invert_yaxis()
    axes.axvline(1.0, color="black", linewidth=0.8)
    axes.set_xlabel("time per training step / reference (torch fused; optax in JAX)")
    axes.set_title("Whole training steps, median of interleaved rounds")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def main(argv=None) -> int:
    args = _parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("mtapply.bench.train needs a CUDA GPU")
    rows = []
    for name in args.models:
        _progress(f"{name}:")
        try:
            model = MODELS[name]()
            rows += run_model(model, args.rounds, args.steps, args.warmup)
        except ImportError as error:  # the model's library is not installed
            rows.append({"model": name, "error": f"{type(error).__name__}: {error}"})
        _free()
    table = format_table(rows)
    print(table)
    with open(args.json, "w") as handle:
        json.dump({"device": torch.cuda.get_device_name(), "rounds": args.rounds,
                   "steps": args.steps, "rows": rows}, handle, indent=1)
    if plot(rows, args.plot):
        print(f"\nplot written to {args.plot}")
    print(f"results written to {args.json}")
    return 0


def _free() -> None:
    import gc

    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m mtapply.bench.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=7, help="rounds of every variant (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: %(default)s)")
    parser.add_argument("--json", default="train_results.json")
    parser.add_argument("--plot", default="train_results.png")
    args = parser.parse_args(argv)
    if min(args.rounds, args.steps) < 1:
        parser.error("--rounds and --steps must be at least 1")
    return args


if __name__ == "__main__":
    sys.exit(main())
