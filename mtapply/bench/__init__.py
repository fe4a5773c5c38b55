"""The benchmark program: `python -m mtapply.bench [--workloads ...] [--only ...] [--json PATH]`.

Times mtapply's Adam against PyTorch's (fused, fused in a CUDA graph, foreach) in one process on
the same random data, and reports each against the byte floor (bytes an Adam step must move over
the device's measured copy bandwidth) and against torch's fused Adam. Needs PyTorch with CUDA
and a GPU; mtapply itself never imports torch, and neither does importing this package.

Modules: `workloads` (the parameter shapes), `competitors` (data and the Adam implementations),
`harness` (bandwidth and timing), `report` (ratios, targets, table, JSON).
"""
