"""The longest model.seq_len a cluster can train: every layout and memory option, bisected.

    python -m ctxpar.plan --config configs/extend_llama3_8b_128k.yaml --set \
        train.global_batch_size=1 parallel.dp=1 --nodes 1 --gpus-per-node 8 --max-seq-len

For each candidate layout (every TP x CP x PP x DP the config allows at micro-batch 1,
each CP pattern (zigzag; also contiguous for a model with windowed or chunked layers,
whose halo exchange needs the least memory there), ZeRO stage and checkpointing mode;
tiled loss and tiled MLP on, which only ever lower the peak, their tiles 'auto' or d_model tokens (ALST's); tiled
linear blocks on (memory.linear_tile_tokens) where the layout has them built; each of the two
offloads on and off, which move bytes to the host; ``Allowed`` narrows them) the peak
memory is affine in seq_len but for the few terms that saturate (buckets,
tile sizes): two evaluations give a first guess, and a bisection over multiples of the
layout's chunk count (num_chunks: 2 cp for zigzag, cp otherwise; config.validate's rule)
settles the largest seq_len whose plan fits the device (less the 10% margin) and the host
(every GPU of a node offloads to it, less 20%). The layouts are then ranked by it.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, replace
import math
from typing import List, Optional, Tuple

from ..config import CHECKPOINT_MODES, Config, ConfigError, validate
from ..config.layer_mixers import has_linear_layers
from ..config.layers import layer_attention
from ..context_parallel.layouts import num_chunks
from .candidate import Candidate, apply_candidate
from .cluster import Cluster, PlanError
from .memory import Memory, ds_zero, memory
from .search import (_cp_patterns, check_modelled, divisors, ep_sizes, fits, is_bf16,
                     linear_strategies)

MAX_SEQ = 1 << 40  # the bisection's ceiling (tokens)


def with_seq_len(cfg: Config, seq_len: int) -> Config:
    """cfg with model.seq_len replaced (a shallow copy: the planner only reads it)."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, seq_len=seq_len))


def unit(cand: Candidate) -> int:
    """seq_len must be a multiple of this: the CP layout's chunks, config.validate's rule,
    which holds at cp 1 too (zigzag: 2)."""
    return num_chunks(cand.cp, cand.token_layout)


OPTIONS = ("tiled_loss", "tiled_mlp", "tiled_linear", "offload_activations",
           "offload_optimizer")
PATTERNS = ("ring", "allgather", "ulysses", "hybrid")


@dataclass(frozen=True)
class Allowed:
    """What the search may use (the memory doc's ladder adds one at a time)."""
    options: Tuple[str, ...] = OPTIONS
    patterns: Tuple[str, ...] = PATTERNS   # () = no context parallelism
    tp: Optional[int] = None               # a fixed TP degree
    pp: Optional[int] = None               # a fixed pipeline degree


def candidates(cfg: Config, cluster: Cluster, allowed: Allowed = Allowed()) -> List[Candidate]:
    """Every layout the trainer accepts at micro-batch 1 with the allowed options: tiled
    loss and MLP on when allowed (they only lower the peak), each offload on and off (on
    only when allowed and the host has memory)."""
    world, out = cluster.world, []
    opt = set(allowed.options)
    offl = cluster.gpu.host_memory > 0
    oas = (False, True) if "offload_activations" in opt and offl else (False,)
    oos = (False, True) if "offload_optimizer" in opt and offl else (False,)
    tl, tm = "tiled_loss" in opt, "tiled_mlp" in opt
    # the linear blocks' tile: the config's, where the layout has them (tiled_linear's
    # rules: config/linear_tiles.py); a layout they are not built with runs them untiled
    lin = cfg.memory.linear_tile_tokens \
        if "tiled_linear" in opt and has_linear_layers(cfg.model) else 0
    # the MLP's tile: the config's (tiled_mlp.py's 'auto': equal tiles of max(d, 512)
    # tokens) and d_model tokens, smaller where d < 512
    tiles = (0, cfg.model.d_model) if tm and cfg.memory.mlp_tile_tokens == "auto" else (0,)
    # the loss's: tiled_loss.py's 'auto' (Liger's, a power of two: up to twice the hidden
    # states' size; at least 512 tokens) and d_model tokens
    loss_tiles = (0, cfg.model.d_model) if tl and cfg.memory.loss_tile_tokens == "auto" \
        else (0,)
    # Full layers hold the same bytes under every layout; windowed or chunked layers hold
    # a halo under contiguous and zigzag (one and two neighbours' tails), whole blocks
    # under striped.
    masked = any(a.sliding_window or a.chunk_size for a in layer_attention(cfg.model))
    layouts = ("zigzag", "contiguous") if masked else ("zigzag",)
    for tp in divisors(cluster.gpus_per_node):
        if allowed.tp and tp != allowed.tp:
            continue
        for cp in divisors(world // tp):
            if cp > 1 and not allowed.patterns:
                continue
            for pp in divisors(world // (tp * cp)):
                if allowed.pp and pp != allowed.pp:
                    continue
                dp = world // (tp * cp * pp)
                for comm, u, token_layout in _cp_patterns(cp):
                    if token_layout not in layouts or (cp > 1 and comm not in allowed.patterns):
                        continue  # striped: zigzag's bytes, another rounding
                    for zero in ((0, 1) if pp > 1 else (0, 1, 2, 3)):
                        for act in CHECKPOINT_MODES:
                            for oa, oo, tile, ltile, linear, ep in itertools.product(
                                    oas, oos, tiles, loss_tiles, linear_strategies(cfg, cp),
                                    ep_sizes(cfg, dp * cp)):
                                cand = Candidate(tp, cp, pp, dp, comm, u, token_layout, zero,
                                                 act, 2 if act == "every_n_layers" else 1, 1,
                                                 tiled_loss=tl, tiled_mlp=tm,
                                                 offload_activations=oa, offload_optimizer=oo,
                                                 mlp_tile=tile, loss_tile=ltile,
                                                 linear_cp=linear, ep=ep, linear_tile=lin)
                                if lin and not _valid(cfg, cand):
                                    cand = replace(cand, linear_tile=0)
                                if _valid(cfg, cand):
                                    out.append(cand)
    return out


def _valid(cfg: Config, cand: Candidate) -> bool:
    u = unit(cand)
    ref = u * max(1, math.ceil(cfg.model.seq_len / u))  # a seq_len this layout accepts
    try:
        validate(apply_candidate(with_seq_len(cfg, ref), cand), world_size=cand.world,
                 check_paths=False)
    except ConfigError:
        return False
    return True


class Bisection:
    """One layout's peak as a function of seq_len = k u (its chunk unit u), and the
    bisection of the largest k that fits the cluster."""

    def __init__(self, cfg: Config, cand: Candidate, cluster: Cluster):
        self.cand, self.cluster, self.u = cand, cluster, unit(cand)
        self.bf16, self.micro = is_bf16(cfg), cfg.train.global_batch_size // cand.dp
        self.zero, self.cfg = ds_zero(cfg, cand), apply_candidate(cfg, cand)

    def mem(self, k: int) -> Memory:
        return memory(with_seq_len(self.cfg, k * self.u), self.cand, self.bf16, self.micro,
                      self.cluster.gpu.kind, self.zero)

    def ok(self, k: int) -> bool:
        return fits(self.mem(k), self.cluster)

    def reaches(self, seq_len: int) -> bool:
        """Whether some seq_len >= this one fits (the peak grows with seq_len)."""
        return self.ok(max(1, math.ceil(seq_len / self.u)))

    def guess(self) -> Optional[int]:
        """The first guess of the largest fitting k from two points of the (nearly) affine
        peak; None if nothing fits (not even one unit of tokens)."""
        k1, k2 = 1, 1 << 10
        m1 = self.mem(k1)
        if not fits(m1, self.cluster):
            return None
        slope = (self.mem(k2).peak - m1.peak) / (k2 - k1)
        cap = 0.9 * self.cluster.gpu.memory
        return int((cap - m1.peak) / slope) + k1 if slope > 0 else MAX_SEQ // self.u

    def longest(self, guess: int) -> Tuple[int, Memory]:
        """(the largest fitting seq_len, its memory), bisected from the guess."""
        top = MAX_SEQ // self.u
        lo, hi = 1, None  # lo fits; hi (if known) does not
        for k in (guess, guess + 1):
            k = max(1, min(k, top))
            if self.ok(k):
                lo = max(lo, k)
            else:
                hi = k if hi is None else min(hi, k)
        if hi is None:  # grow until it does not fit
            hi = max(lo * 2, 2)
            while hi < top and self.ok(hi):
                lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.ok(mid):
                lo = mid
            else:
                hi = mid
        return lo * self.u, self.mem(lo)


def longest(cfg: Config, cand: Candidate, cluster: Cluster) -> Tuple[int, Optional[Memory]]:
    """(the largest fitting seq_len, its memory) of one layout; (0, None) if none fits."""
    b = Bisection(cfg, cand, cluster)
    guess = b.guess()
    return (0, None) if guess is None else b.longest(guess)


class LongestRows(list):
    """search_longest's rows, and how many layouts fit at some length."""

    def __init__(self, rows=(), fitting: int = 0):
        super().__init__(rows)
        self.fitting = fitting


def search_longest(cfg: Config, cluster: Cluster, allowed: Allowed = Allowed(),
                   top: Optional[int] = None) -> List[Tuple[int, Candidate, Memory]]:
    """(seq_len, layout, memory) of every candidate that fits at some length, longest
    first (ties: the least device memory); with `top`, the first `top` rows after
    merge_tiles exactly, and only the rows bisected on the way: the layouts are bisected
    in the order of their first guesses, and one that cannot reach the top-th length found
    so far (one evaluation there) is left out. The rows' `fitting`: how many layouts fit
    at some length (tile sizes counted apart)."""
    check_modelled(cfg)
    cands = candidates(cfg, cluster, allowed)
    if not cands:
        raise PlanError(f"no layout of {cluster.world} GPUs ({cluster.nodes} x "
                        f"{cluster.gpus_per_node}) is valid for this model at micro-batch 1 "
                        f"(heads {cfg.model.n_heads}, layers {cfg.model.n_layers}, global "
                        f"batch {cfg.train.global_batch_size})")
    guessed = []
    for cand in cands:
        b = Bisection(cfg, cand, cluster)
        guess = b.guess()
        if guess is not None:
            guessed.append((guess * b.u, b, guess))
    guessed.sort(key=lambda r: -r[0])  # likely long ones first: the bar rises early
    out, bar = LongestRows(fitting=len(guessed)), 0
    for _, b, guess in guessed:
        if bar and not b.reaches(bar):
            continue  # its longest is below the top-th row's: not among the first `top`
        n, m = b.longest(guess)
        out.append((n, b.cand, m))
        if top:
            out.sort(key=lambda r: (-r[0], r[2].peak))
            kept = merge_tiles(out)
            bar = kept[top - 1][0] if len(kept) >= top else 0
    out.sort(key=lambda r: (-r[0], r[2].peak))
    return out


def merge_tiles(rows: List[Tuple[int, Candidate, Memory]]) -> List[Tuple[int, Candidate, Memory]]:
    """search_longest's rows with one per layout and length: the tiles that reach the same
    seq_len as another tile size of the same layout are left out (the first, the least
    memory, stays)."""
    seen, out = set(), []
    for n, cand, m in rows:
        key = (n, dataclasses.replace(cand, mlp_tile=0, loss_tile=0))
        if key not in seen:
            seen.add(key)
            out.append((n, cand, m))
    return out
