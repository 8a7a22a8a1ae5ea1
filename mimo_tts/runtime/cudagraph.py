"""The CUDA-graph capture recipe shared by the LM decode step and the codec decoder."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(fn: Callable[[], object], *, warmup: int = 1, pool=None):
    """Run `fn` `warmup` times on a side stream (kernel choice, workspaces and lazily built
    tables happen outside the graph), then record one call in a CUDA graph on the current
    device; returns (graph, fn's output, whose tensors the graph's replays refill).
    `pool`: a `torch.cuda.graph_pool_handle()` to share memory with other graphs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out
