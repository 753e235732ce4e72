"""The PyTorch baseline's weights are changed as jaxllm's are (the timing itself needs a GPU)."""

import pytest
import torch

from tools.bench_torch_forward import scale_qk_norms
from tools.make_checkpoint import build_config
from tools.torch_stand_ins import stand_in


@pytest.mark.parametrize("arch", ["llada2", "sdar"])
def test_only_the_q_and_k_norms_are_scaled(arch):
    model_class, config = stand_in(build_config(arch, "tiny", "bf16"))
    model = model_class(config)
    before = {name: weight.detach().clone() for name, weight in model.named_parameters()}
    scale_qk_norms(model, 3.0)
    scaled = 0
    for name, weight in model.named_parameters():
        is_qk_norm = ".q_norm." in name or ".k_norm." in name
        torch.testing.assert_close(weight.detach(), before[name] * (3.0 if is_qk_norm else 1.0), rtol=0, atol=0)
        scaled += is_qk_norm
    assert scaled == 2 * config.num_hidden_layers
