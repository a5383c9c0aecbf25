"""The Gated DeltaNet layer (model/gated_deltanet.py) against transformers 5.25's Qwen3_5GatedDeltaNet
(its torch fallbacks: the oracle) on a tiny random config with grouped heads (2 key heads serving 4
value heads): a prompt in one call; the same prompt in pieces carrying the state (chunk boundaries
anywhere, pieces shorter than the convolution); then token-by-token decode from the state; in
float32 (1e-5) and bf16 (the rounding transformers does, within bf16's)."""

import pytest
import torch

from ringctx.model.gated_deltanet import GatedDeltaNet, LinearShape
from tests.helpers import one_thread_for_module, rel_err

one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_module)

DIM = 64
SHAPE = LinearShape(key_heads=2, value_heads=4, key_dim=16, value_dim=8, conv_width=4)


def layers(dtype):
    """(transformers' layer, ringctx's) with the same random weights, in dtype."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(hidden_size=DIM, num_hidden_layers=4, linear_num_key_heads=SHAPE.key_heads,
                               linear_num_value_heads=SHAPE.value_heads, linear_key_head_dim=SHAPE.key_dim,
                               linear_value_head_dim=SHAPE.value_dim, linear_conv_kernel_dim=SHAPE.conv_width,
                               rms_norm_eps=1e-6)
    torch.manual_seed(0)
    hf = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.2)
        hf.A_log.copy_(torch.log(torch.empty_like(hf.A_log).uniform_(0.01, 4)))
    ours = GatedDeltaNet(DIM, SHAPE, 1e-6)
    with torch.no_grad():
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
            getattr(ours, name).weight.copy_(getattr(hf, name).weight)
        ours.conv_weight.copy_(hf.conv1d.weight[:, 0])
        ours.dt_bias.copy_(hf.dt_bias)
        ours.A_log.copy_(hf.A_log)
        ours.norm_weight.copy_(hf.norm.weight)
    return hf.to(dtype), ours.to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-3)])
def test_prompt_in_one_call_in_pieces_and_decoded_equals_transformers(dtype, tol):
    hf, ours = layers(dtype)
    x = torch.randn(150, DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        ref = hf(x[None])[0]
        whole, _ = ours(x)
        assert rel_err(whole, ref) < tol
        pieces, state = [], None
        for a, b in [(0, 2), (2, 3), (3, 70), (70, 135), (135, 140)]:  # then decode 140..149
            y, state = ours(x[a:b], state)
            pieces.append(y)
        for t in range(140, 150):
            y, state = ours(x[t:t + 1], state)
            pieces.append(y)
        assert rel_err(torch.cat(pieces), ref) < tol


def test_the_state_after_a_prompt_is_transformers_cache_state():
    """The recurrent state and the convolution inputs after a prompt equal those transformers'
    cache holds (the decode of a saved document starts from them)."""
    from transformers import DynamicCache

    hf, ours = layers(torch.float32)
    x = torch.randn(37, DIM, generator=torch.Generator().manual_seed(2))
    cache = DynamicCache(config=hf_config(hf))
    with torch.no_grad():
        hf(x[None], cache=cache)
        _, state = ours(x)
    recurrent = cache.get_recurrent_state(0, state_idx=0)[0]
    conv = cache.get_conv_state(0, state_idx=0)[0]  # [C, K] or [C, K-1]: its last K-1 columns are ours
    assert rel_err(state.recurrent, recurrent) < 1e-5
    assert torch.allclose(state.conv, conv[:, -(SHAPE.conv_width - 1):].t())


def hf_config(hf_layer):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(hidden_size=DIM, num_hidden_layers=1, layer_types=["linear_attention"],
                             linear_num_key_heads=SHAPE.key_heads, linear_num_value_heads=SHAPE.value_heads,
                             linear_key_head_dim=SHAPE.key_dim, linear_value_head_dim=SHAPE.value_dim,
                             linear_conv_kernel_dim=SHAPE.conv_width)
