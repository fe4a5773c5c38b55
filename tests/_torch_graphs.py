"""Capturing a whole torch training step in a CUDA graph, as the GPU tests of the adapters do."""


def capture(train_step, warmups: int = 3):
    """A graph of `train_step()`, captured after `warmups` eager calls on a side stream, so that
    grads, optimizer states, kernels and pointer tables all exist before capture."""
    import torch  # only GPU tests call this; the modules importing it skip without torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            train_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train_step()
    return graph
