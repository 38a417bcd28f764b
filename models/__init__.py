"""The application above ctxpar: the GPT built on its parallel layers, and what the
entrypoints share around it.

    gpt.py, gpt_pipe.py    the GPT (Llama, Qwen, Mistral, Gemma as fields) and its pipeline form
    loss.py                the global token-mean loss under DeepSpeed's reduction
    options.py             what a model is built with besides its ModelConfig
    training.py            the rank grid's model and DeepSpeed engine (train.py, verify.py)
    steps.py               the kinds of optimizer step, decided once (train.py, verify.py)
    dynamic_cp.py          one step of data.dynamic_cp's packs (steps.DynamicSteps)
    inference.py           a run's checkpoint on a tp x cp grid (generate.py,
                           tools/long_context_eval.py)
"""
from .gpt import GPT
from .loss import (
    count_tokens,
    deepspeed_style_reduce_,
    global_mean_loss,
    global_token_count,
    loss_for_backward,
)
