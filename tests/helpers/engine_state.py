"""What a DeepSpeed engine's model states hold: the bytes of every live CPU tensor, before
and after one engine is built and steps once (tests/test_plan.py, test_plan_moe.py)."""
import gc

import torch


def live_tensor_bytes():
    """{storage: bytes} of every CPU tensor Python holds."""
    seen = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            s = o.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return seen


def bytes_after_one_step(model, opt, st, ds, tok, pos, before) -> int:
    """DeepSpeed's engine over model and opt takes one step on tok (its own labels); the
    bytes of the tensors alive then that were not in ``before`` (live_tensor_bytes)."""
    import deepspeed
    from ctxpar import DeepSpeedMPU
    from ctxpar.distributed.zero import grad_divisor
    from models.loss import global_token_count, loss_for_backward

    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds,
                                      mpu=DeepSpeedMPU(st))
    n = global_token_count(tok, st.dp_cp_group)
    loss = engine(tok, pos, tok)
    engine.backward(loss_for_backward(loss, n, grad_divisor(st, ds)))
    del loss
    engine.step()  # Adam's state exists from here on
    gc.collect()
    after = live_tensor_bytes()
    return sum(v for k, v in after.items() if k not in before)
