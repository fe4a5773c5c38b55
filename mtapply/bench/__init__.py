"""The benchmark program: `python -m mtapply.bench [--op ...] [--workloads ...] [--only ...]`.

Times mtapply's fused optimizer steps (Adam, in fp32 and in bf16 with fp32 master weights; SGD
with momentum; LARS) against their peers (torch.optim's fused, fused in a CUDA graph and foreach
steps; for LARS a per-tensor PyTorch loop, the loop in a CUDA graph and optax under jax.jit) in one
process on the same random data, and reports each against the byte floor (the bytes mtapply's step
must move over the device's measured copy bandwidth) and against the op's reference peer. Needs
PyTorch with CUDA and a GPU; mtapply itself never imports torch, and neither does importing this
package.

Modules: `workloads` (the parameter shapes and dtypes), `ops` (the registry of ops), one module
per op (`adam`, `sgd`, `lars`: data, competitors, bytes per parameter, targets), `common` (what the
ops share), `harness` (bandwidth and timing), `report` (ratios, targets, table, JSON).
"""
