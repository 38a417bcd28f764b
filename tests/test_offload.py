"""Activation offload (ctxpar/memory/offload.py): same numbers, block inputs off the device.

On CPU the "host" copy is a separate CPU tensor and coming back is a copy: the forward and
backward compute exactly the same values from exactly the same bits, so loss and every
gradient are compared for equality (torch.equal), with and without the tiled MLP.
"""
import weakref

import pytest
import torch
import torch.nn as nn

from ctxpar.config import MemoryConfig, ModelConfig
from ctxpar.memory.offload import ActivationOffload, run_layer
from models.gpt import GPT
from models.options import ModelOptions

# Block input x: B * T * d * 4 = 128 KiB, over the 64 KiB floor; the LSE (8 KiB) is under it.
B, T, L = 2, 256, 3
CFG = ModelConfig(vocab_size=128, seq_len=T, n_layers=L, d_model=64, n_heads=4, n_kv_heads=2)
X_BYTES = B * T * 64 * 4
# selective per layer: x, q (nh*hd = 64), k and v (nkv*hd = 32 each), out (64), fp32;
# x saved by both checkpoints and out returned as the o-projection's input: copied once.
SELECTIVE_BYTES = B * T * (64 + 64 + 32 + 32 + 64) * 4
HOST_AFTER_FORWARD = {"full": L * X_BYTES, "every_n_layers": 2 * X_BYTES,  # layers 0, 2
                      "selective": L * SELECTIVE_BYTES}
PER_LAYER = {"full": X_BYTES, "every_n_layers": X_BYTES, "selective": SELECTIVE_BYTES}


def _batch():
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CFG.vocab_size, (B, T), generator=g),
            torch.randint(0, CFG.vocab_size, (B, T), generator=g))


def _step(mode, offload, tiled):
    """Loss, grads, the checkpointed blocks' inputs alive after the forward, offload stats."""
    memory = MemoryConfig(offload_activations=offload, tiled_mlp=tiled, mlp_tile_tokens=100)
    model = GPT(CFG, options=ModelOptions(activation_checkpointing=mode, every_n_layers=2,
                                          memory=memory, seed=1))
    tokens, labels = _batch()
    inputs, forward = [], [True]
    for i, layer in enumerate(model.layers):
        if model._checkpointed(i) or mode == "selective":
            layer.register_forward_pre_hook(
                lambda m, args: inputs.append(weakref.ref(args[0])) if forward[0] else None)
    loss = model(tokens, torch.arange(T), labels)
    forward[0] = False
    alive = sum(r() is not None for r in inputs)
    after_forward = model.offload.stats() if offload else None
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, alive, len(inputs), after_forward, \
        model.offload.stats() if offload else None


@pytest.mark.parametrize("mode", ["full", "selective", "every_n_layers"])
def test_offload_exact_and_block_inputs_leave(mode):
    for tiled in (False, True):
        loss0, grads0, alive0, n_inputs, _, _ = _step(mode, False, tiled)
        loss, grads, alive, _, fwd, bwd = _step(mode, True, tiled)
        assert torch.equal(loss, loss0)
        for n, g in grads0.items():
            assert torch.equal(grads[n], g), (mode, tiled, n)
        # Without offload checkpointing holds every block input until backward; with it
        # none is left on the device (nothing else references them).
        assert alive0 == n_inputs > 0 and alive == 0, (mode, alive0, alive)
        assert fwd["device_bytes"] == 0 and fwd["host_bytes"] == HOST_AFTER_FORWARD[mode]
        # Backward: the layer being back-propagated plus the one prefetched behind it.
        assert bwd["peak_device_bytes"] == 2 * PER_LAYER[mode], bwd
        assert bwd["device_bytes"] == 0 and bwd["host_bytes"] == 0  # all handed back, freed


@pytest.mark.quick
def test_parameters_leaves_and_shared_tensors_stay_same_tensor_copied_once():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(128, 128))  # 64 KiB: big enough to move, but a parameter
    x = torch.randn(256, 128, requires_grad=True)  # a leaf its owner holds
    shared = torch.randn(256, 128)  # like RoPE's cos/sin: registered with keep()

    def layer(x):
        h = x * 2  # (256, 128) fp32 = 128 KiB, saved twice below
        y = torch.tanh(h @ w.t())  # saves h and a view of the parameter; tanh its output
        return (y * shared + h * h).sum()

    want = torch.autograd.grad(layer(x), (x, w))
    off = ActivationOffload()
    off.keep(shared)
    got = torch.autograd.grad(run_layer(off, layer, x), (x, w))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # Moved: h once (saved by the matmul and twice by h * h) and tanh's output.
    assert off.peak_host_bytes == 2 * 256 * 128 * 4
    assert off.kept_bytes == 256 * 128 * 4  # shared; never the parameter nor the leaf x
    assert off.host_bytes == off.device_bytes == 0
    assert run_layer(None, layer, x) is not None  # no offload: a plain call
