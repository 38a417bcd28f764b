"""One candidate the planner weighs: a rank layout (tp x cp x pp x dp, the CP pattern and
its token layout) (and the experts' parallel.ep) with the keys of a config's activation_checkpointing, ZeRO and memory
sections; and the config with them set (apply_candidate)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from ..config import Config


@dataclass(frozen=True)
class Candidate:
    tp: int
    cp: int
    pp: int
    dp: int
    cp_comm: str = "ring"          # ring | allgather | ulysses | hybrid
    ulysses: int = 1               # Ulysses degree (cp for 'ulysses', the inner one for hybrid)
    token_layout: str = "zigzag"   # parallel.layout: the tokens' order over CP
    zero: int = 1                  # ZeRO stage
    activation: str = "none"       # none | selective | full | every_n_layers
    every_n_layers: int = 1
    micro_batch: int = 1
    ring_grad_dtype: str = "fp32"
    tiled_loss: bool = False           # memory.tiled_loss
    tiled_mlp: bool = False            # memory.tiled_mlp
    offload_activations: bool = False  # memory.offload_activations
    offload_optimizer: bool = False    # zero_optimization.offload_optimizer.device = cpu
    mlp_tile: int = 0                  # memory.mlp_tile_tokens when > 0 (else the config's)
    loss_tile: int = 0                 # memory.loss_tile_tokens when > 0 (else the config's)
    linear_cp: str = "state"           # parallel.linear_cp: the linear layers' CP strategy
    ep: int = 1                        # parallel.ep: experts split over ep of the dp x cp ranks
    linear_tile: int = 0               # memory.linear_tile_tokens under memory.tiled_linear
    #                                    (0: the linear blocks untiled)

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def ring(self) -> int:
        """Ranks of the ring part (cp for 'ring', cp/u for 'hybrid', none otherwise: 1)."""
        if self.cp_comm == "ring":
            return self.cp
        return self.cp // self.ulysses if self.cp_comm == "hybrid" else 1

    def name(self) -> str:
        cp = f"cp{self.cp}"
        if self.cp > 1:
            tokens = self.token_layout
            cp += {"ring": f" ring/{tokens}", "allgather": f" allgather/{tokens}",
                   "ulysses": " ulysses",
                   "hybrid": f" hybrid u{self.ulysses}/{tokens}"}[self.cp_comm]
            cp += " linear-heads" if self.linear_cp == "heads" else ""
        opts = "".join(f" +{n}" for n, on in (
            (f"tiled-loss{f'({self.loss_tile})' if self.loss_tile else ''}", self.tiled_loss),
            (f"tiled-mlp{f'({self.mlp_tile})' if self.mlp_tile else ''}", self.tiled_mlp),
            (f"tiled-linear({self.linear_tile})", self.linear_tile),
            ("offload-act", self.offload_activations), ("offload-opt", self.offload_optimizer))
            if on)
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        return (f"tp{self.tp} {cp} pp{self.pp} dp{self.dp}{ep} z{self.zero} "
                f"{self.activation} mb{self.micro_batch}{opts}")


def apply_candidate(cfg: Config, cand: Candidate) -> Config:
    """A copy of cfg with the layout's keys set (what --write saves). The sections it sets
    (parallel, activation_checkpointing, train, memory, deepspeed) are new objects; the
    others are cfg's own, shared: the planner never writes into a config (it derives one
    with dataclasses.replace), and a deep copy per candidate was a third of a search's time.
    """
    p = cfg.parallel
    parallel = replace(
        p, tp=cand.tp, cp=cand.cp, pp=cand.pp, dp=cand.dp, cp_comm=cand.cp_comm,
        layout=cand.token_layout, ring_grad_dtype=cand.ring_grad_dtype,
        linear_cp=cand.linear_cp, ep=cand.ep,
        ulysses=cand.ulysses if cand.cp_comm in ("ulysses", "hybrid") and cand.cp > 1 else None)
    checkpointing = replace(cfg.activation_checkpointing, mode=cand.activation,
                            every_n_layers=cand.every_n_layers)
    tiles = {**({"mlp_tile_tokens": cand.mlp_tile} if cand.mlp_tile else {}),
             **({"loss_tile_tokens": cand.loss_tile} if cand.loss_tile else {})}
    if cand.linear_tile:
        tiles["linear_tile_tokens"] = cand.linear_tile
    memory = replace(cfg.memory, tiled_loss=cand.tiled_loss, tiled_mlp=cand.tiled_mlp,
                     tiled_linear=bool(cand.linear_tile),
                     offload_activations=cand.offload_activations, **tiles)
    ds = copy.deepcopy(cfg.deepspeed)
    z = ds.setdefault("zero_optimization", {})
    z["stage"] = cand.zero
    if cand.offload_optimizer:
        z["offload_optimizer"] = {**(z.get("offload_optimizer") or {}), "device": "cpu"}
    elif (z.get("offload_optimizer") or {}).get("device") == "cpu":
        z.pop("offload_optimizer")
    return replace(cfg, parallel=parallel, activation_checkpointing=checkpointing,
                   train=replace(cfg.train, micro_batch_size=cand.micro_batch),
                   memory=memory, deepspeed=ds)
