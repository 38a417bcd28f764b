"""The application above ctxpar: the GPT built on its parallel layers, and what the
entrypoints share around it.

    gpt.py, gpt_pipe.py    the GPT (Llama, Qwen, Mistral, Gemma as fields) and its pipeline form
    block.py               one layer: a token mixer and a channel mixer, looked up by kind
    mixers.py              the registry of kinds: TOKEN_MIXERS, CHANNEL_MIXERS
    token_mixer.py         what a Block asks of a token mixer (project_in, mix, project_out)
    attention.py           attention (MHA, GQA; windows, chunks, sinks, gates)
    gated_delta.py         Gated DeltaNet          mamba2.py   Mamba2
    short_conv.py          the short causal conv both run before their core
    mlp.py, moe.py         the channel mixers: the dense MLP, a mixture of experts
    rope.py, norms.py      RoPE and its scalings; the block norms (qk_norm.py: q/k over all heads)
    loss.py                the global token-mean loss under DeepSpeed's reduction
    options.py             what a model and each layer are built with besides its ModelConfig
    training.py            the rank grid's model and DeepSpeed engine (train.py, verify.py)
    steps.py               the kind of optimizer step, decided once (train.py, verify.py);
                           the kinds in step_kinds.py and moe_steps.py
    dynamic_cp.py          one step of data.dynamic_cp's packs (step_kinds.DynamicSteps)
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
