"""One candidate layout: the keys of a config's parallel / checkpointing / ZeRO sections."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    tp: int
    cp: int
    pp: int
    dp: int
    cp_comm: str = "ring"          # ring | allgather | ulysses | hybrid
    ulysses: int = 1               # Ulysses degree (cp for 'ulysses', the inner one for hybrid)
    layout: str = "zigzag"         # token layout over CP
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
            cp += {"ring": f" ring/{self.layout}", "allgather": f" allgather/{self.layout}",
                   "ulysses": " ulysses",
                   "hybrid": f" hybrid u{self.ulysses}/{self.layout}"}[self.cp_comm]
        opts = "".join(f" +{n}" for n, on in (
            (f"tiled-loss{f'({self.loss_tile})' if self.loss_tile else ''}", self.tiled_loss),
            (f"tiled-mlp{f'({self.mlp_tile})' if self.mlp_tile else ''}", self.tiled_mlp),
            ("offload-act", self.offload_activations), ("offload-opt", self.offload_optimizer))
            if on)
        return (f"tp{self.tp} {cp} pp{self.pp} dp{self.dp} z{self.zero} "
                f"{self.activation} mb{self.micro_batch}{opts}")
