"""Updates a list of tensors with mtapply.adam_step and checks it against torch.optim.Adam.

Runs on the GPU when one is present (one fused launch for the whole list), else on the CPU
(the NumPy backend). Usage: python examples/adam_quickstart.py
"""
import torch

import mtapply

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
shapes = [(256, 128), (128,), (0,), (1000, 10), (7,)]
params = [torch.randn(s, device=device) for s in shapes]
reference = [p.clone().requires_grad_() for p in params]
exp_avgs = [torch.zeros_like(p) for p in params]
exp_avg_sqs = [torch.zeros_like(p) for p in params]
torch_adamw = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.01, foreach=False)

for step in range(1, 11):
    grads = [torch.randn_like(p) for p in params]
    for r, g in zip(reference, grads):
        r.grad = g.clone()
    torch_adamw.step()
    mtapply.adam_step(params, grads, exp_avgs, exp_avg_sqs, lr=1e-2, step=step,
                      weight_decay=0.01, decoupled_weight_decay=True)

worst = max((p - r.detach()).abs().max().item() for p, r in zip(params, reference) if p.numel())
print(f"device={device} tensors={len(params)} steps=10 max|mtapply - torch.optim.AdamW| = {worst:.2e}")
assert worst < 1e-5, "mtapply and torch.optim.AdamW disagree"
print("OK: mtapply.adam_step matches torch.optim.AdamW")
