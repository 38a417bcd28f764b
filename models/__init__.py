"""Models built on ctxpar's parallel layers."""
from .gpt import GPT
from .loss import (
    count_tokens,
    deepspeed_style_reduce_,
    global_mean_loss,
    global_token_count,
    loss_for_backward,
)
