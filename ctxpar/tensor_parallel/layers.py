"""Megatron's tensor-parallel layers (Shoeybi et al., 2019), taking the TP group explicitly.

A p-way split of Y = XA + b (A = weight^T: in x out; the weight is stored out x in):

    ColumnParallelLinear    A split by columns: rank i computes Y_i = X A_i + b_i
    RowParallelLinear       A split by rows: Y = g(sum_i X_i A_i) + b
    VocabParallelEmbedding  E split by vocabulary rows: Y = g(sum_i E_i[t] 1[t in V_i])
    ReplicatedHeadLinear    A replicated; rank r uses head block r*n/p (kv heads < tp)

Column then row (attention projections, MLP) needs one all-reduce forward (g) and one
backward (f, applied once by the caller for projections that share an input).

Split parameters carry Megatron's attributes ``tensor_model_parallel``, ``partition_dim``,
``partition_stride`` and also ``model_parallel``: DeepSpeed's grad-norm code
(deepspeed/runtime/utils.py ``is_model_parallel_parameter``) counts a parameter on every
TP rank when either is true, and only on TP rank 0 otherwise. So split weights contribute
each shard once, replicated ones (norms, ReplicatedHeadLinear, row-parallel bias) once.
Layers allocate uninitialised (``torch.empty``, meta-safe); models/gpt.py fills them from
full-size seeded tensors so every TP degree starts from the same model.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
    select_replicated_rows,
    tp_rank_of,
    tp_size_of,
)


def set_tensor_model_parallel_attributes(param: nn.Parameter, is_parallel: bool,
                                         dim: int, stride: int = 1,
                                         sections: Optional[Sequence[int]] = None) -> None:
    """Mark a parameter as split along ``dim`` (Megatron's names) or as replicated.
    sections: a fused parameter's parts along ``dim`` (full sizes, e.g. a GDN's
    [q | k | v] rows), each split over TP on its own: a rank holds [q_r | k_r | v_r]."""
    param.tensor_model_parallel = is_parallel
    param.model_parallel = is_parallel  # what DeepSpeed's grad-norm code reads
    param.partition_dim = dim if is_parallel else -1
    param.partition_stride = stride
    param.partition_sections = tuple(sections) if is_parallel and sections else None


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tp={d}")
    return n // d


def _param(shape, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))


def column_parallel_parameter(shape: Sequence[int], tp_group, sections=None, device=None,
                              dtype=None, what: str = "rows") -> nn.Parameter:
    """An uninitialised parameter of full ``shape`` split along dim 0 over TP (per-head
    vectors such as A_log, a depthwise conv's channels); with ``sections`` each part of
    dim 0 is split on its own (set_tensor_model_parallel_attributes)."""
    tp = tp_size_of(tp_group)
    for n in sections or (shape[0],):
        _divide(n, tp, what)
    param = _param((shape[0] // tp, *shape[1:]), device, dtype)
    set_tensor_model_parallel_attributes(param, True, dim=0, sections=sections)
    return param


class ColumnParallelLinear(nn.Module):
    """Y = XA + b, A split by columns: A = [A_1 … A_p]; rank i computes Y_i = XA_i + b_i.

    ``copy_input`` applies f (identity fwd, all-reduce of dX bwd); turn it off when the
    caller applied f once for several projections of the same input. ``gather_output``
    all-gathers Y along the last dim (otherwise Y stays split, as a row layer expects).
    ``sections``: a fused projection's output parts (full sizes summing to out_features),
    each split on its own, so rank i computes [Y_1,i | Y_2,i | ...] (Megatron's fused
    Mamba in_proj; a GDN's [q | k | v]).
    """

    def __init__(self, in_features: int, out_features: int, *, tp_group, bias: bool = True,
                 gather_output: bool = False, copy_input: bool = True,
                 sections: Optional[Sequence[int]] = None, device=None, dtype=None):
        super().__init__()
        assert sections is None or sum(sections) == out_features, (sections, out_features)
        assert sections is None or not gather_output, "a gathered output would be permuted"
        self.tp_group, self.gather_output, self.copy_input = tp_group, gather_output, copy_input
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = _divide(out_features, tp_size_of(tp_group), "out_features")
        self.weight = column_parallel_parameter((out_features, in_features), tp_group,
                                                sections, device, dtype, "out_features")
        self.bias = column_parallel_parameter((out_features,), tp_group, sections, device,
                                              dtype, "out_features") if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        y = F.linear(x, self.weight, self.bias)  # (..., out/tp)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.tp_group)  # (..., out)
        return y


class RowParallelLinear(nn.Module):
    """Y = XA + b, A split by rows: A = [A_1; …; A_p], X = [X_1 … X_p]; Y = g(sum_i X_i A_i) + b.

    ``input_is_parallel``: X arrives split along its last dim (from a column layer);
    otherwise it is scattered here. The bias is replicated and added after the reduce.
    """

    def __init__(self, in_features: int, out_features: int, *, tp_group, bias: bool = True,
                 input_is_parallel: bool = True, device=None, dtype=None):
        super().__init__()
        self.tp_group, self.input_is_parallel = tp_group, input_is_parallel
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = _divide(in_features, tp_size_of(tp_group), "in_features")
        self.weight = _param((out_features, self.in_per_rank), device, dtype)
        set_tensor_model_parallel_attributes(self.weight, True, dim=1)
        self.bias = _param((out_features,), device, dtype) if bias else None
        if bias:
            set_tensor_model_parallel_attributes(self.bias, False, dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        y = F.linear(x, self.weight)  # (..., out): this rank's partial sum
        y = reduce_from_tensor_model_parallel_region(y, self.tp_group, inplace=True)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Y = E[t], E split by vocabulary rows: E = [E_1; …; E_p]; Y = g(sum_i E_i[t] 1[t in V_i])."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group,
                 device=None, dtype=None):
        super().__init__()
        self.tp_group = tp_group
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_per_rank = _divide(num_embeddings, tp_size_of(tp_group), "vocab_size")
        self.vocab_start = tp_rank_of(tp_group) * self.vocab_per_rank
        self.weight = _param((self.vocab_per_rank, embedding_dim), device, dtype)
        set_tensor_model_parallel_attributes(self.weight, True, dim=0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tp_size_of(self.tp_group) == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)  # (..., d)
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)  # other ranks own these rows
        return reduce_from_tensor_model_parallel_region(y, self.tp_group, inplace=True)


class ReplicatedHeadLinear(nn.Module):
    """Y = XA_h + b_h, A = [A_1 … A_n] replicated on every TP rank; rank r uses h = r*n/p.

    For GQA with n_kv_heads < tp (tp % n_kv_heads == 0): p/n ranks share each kv head.
    dA is all-reduced over TP (weight-sized, independent of the sequence length), so all
    copies hold the same full gradient and stay equal; the input takes the caller's f.
    """

    def __init__(self, in_features: int, out_features: int, n_blocks: int, *, tp_group,
                 bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.tp_group, self.n_blocks = tp_group, n_blocks
        self.in_features, self.out_features = in_features, out_features
        if tp_size_of(tp_group) % n_blocks or out_features % n_blocks:
            raise ValueError(f"{n_blocks} heads cannot be shared by tp={tp_size_of(tp_group)}")
        self.weight = _param((out_features, in_features), device, dtype)
        set_tensor_model_parallel_attributes(self.weight, False, dim=0)
        self.bias = _param((out_features,), device, dtype) if bias else None
        if bias:
            set_tensor_model_parallel_attributes(self.bias, False, dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = select_replicated_rows(self.weight, self.n_blocks, self.tp_group)  # (out/n, in)
        b = (select_replicated_rows(self.bias, self.n_blocks, self.tp_group)
             if self.bias is not None else None)
        return F.linear(x, w, b)  # (..., out/n)


def parallel_lm_logits(x: torch.Tensor, weight: torch.Tensor, tp_group,
                       bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Logits_i = f(X) E_i^T, E split by vocabulary rows; stays split for the parallel loss."""
    x = copy_to_tensor_model_parallel_region(x, tp_group)
    return F.linear(x, weight, bias)  # (..., V/tp)
