"""Residual vector quantizer (spec §3.4), always computed in float32.

Module names follow the checkpoint: `quantizer.vq.layers.{i}._codebook.embed`. The EMA training
buffers (`embed_avg`, `cluster_size`, `inited`) are not modelled; the loader ignores them.
Shapes: T frames, K codebooks (quantizer layers), C codebook entries, d model width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mimo_tts.runtime.fixed_order import product


class Codebook(nn.Module):
    """One codebook: `embed` [C, d] is a persistent buffer (it is not trained by gradients)."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.register_buffer("embed", torch.empty(size, dim, dtype=torch.float32))

    def nearest(self, residual: Tensor) -> Tensor:
        """Index of the nearest codeword by squared Euclidean distance: [T, d] -> [T]."""
        embed = self.embed
        dist = (
            residual.pow(2).sum(1, keepdim=True)
            - 2 * product(residual, embed)  # residual @ embed.T in a fixed order
            + embed.pow(2).sum(1)[None, :]
        )  # [T, C]
        return (-dist).argmax(dim=-1)


class VectorQuantization(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self._codebook = Codebook(size, dim)


class ResidualVQ(nn.Module):
    def __init__(self, sizes: tuple[int, ...], dim: int):
        super().__init__()
        self.layers = nn.ModuleList(VectorQuantization(size, dim) for size in sizes)


class ResidualVectorQuantizer(nn.Module):
    """The tokenizer's RVQ: `encode` hidden -> codes, `decode` codes -> summed codewords."""

    def __init__(self, sizes: tuple[int, ...], dim: int):
        super().__init__()
        self.sizes = tuple(sizes)
        self.vq = ResidualVQ(self.sizes, dim)

    def encode(self, hidden: Tensor, n_q: int | None = None) -> Tensor:
        """hidden [T, d] -> codes [K, T] int64 (K = n_q or every layer), residual in float32."""
        residual = hidden.float()
        codes = []
        for layer in list(self.vq.layers)[: n_q or len(self.vq.layers)]:
            index = layer._codebook.nearest(residual)
            residual = residual - layer._codebook.embed.index_select(0, index)
            codes.append(index)
        return torch.stack(codes)

    def decode(self, codes: Tensor) -> Tensor:
        """codes [K, T] -> [T, d] float32: the sum of the first K codebooks' rows."""
        hidden = None
        for row, layer in zip(codes, self.vq.layers, strict=False):
            # index_select, not advanced indexing: the latter is ~50x slower on CPU here.
            part = layer._codebook.embed.index_select(0, row)
            hidden = part if hidden is None else hidden + part
        return hidden
