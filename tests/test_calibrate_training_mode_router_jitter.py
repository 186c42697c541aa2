"""MoE blocks that scale their hidden states by uniform noise while training (transformers' Mixtral
with ``router_jitter_noise`` > 0: ``jitter_noise`` on its sparse MoE block, as MiniMax and Switch
Transformers; PhiMoE's ``input_jitter_noise``; DBRX's ``moe_jitter_eps``), or that sample their experts
while training (PhiMoE's router with ``router_jitter_noise`` > 0), hold no dropout module: calibrating
one in training mode warns naming it, as for dropout; in eval mode, or without noise, it does not."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")

RECIPE = qstats.Recipe([qstats.Rule("Linear", sites=("input",))])


def _mixtral(jitter: float):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=32, router_jitter_noise=jitter)
    return transformers.MixtralForCausalLM(config)


def _batches():
    return [{"input_ids": torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))}]


def _calibrates_without_warning(model) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qstats.calibrate(model, _batches(), RECIPE, progress=False)


def test_router_jitter_noise_in_training_mode_warns_naming_the_moe_block():
    model = _mixtral(0.1).train()
    ids = _batches()[0]["input_ids"]
    with torch.no_grad():  # transformers: random outputs while training, the same ones in eval mode
        assert not torch.equal(model(ids).logits, model(ids).logits)
        model.eval()
        assert torch.equal(model(ids).logits, model(ids).logits)
    model.train()
    with pytest.warns(UserWarning, match=r"calibrate: module 'model.layers.0.mlp' \(MixtralSparseMoeBlock\) is in "
                                         r"training mode"):
        qstats.calibrate(model, _batches(), RECIPE, progress=False)
    model.eval()
    _calibrates_without_warning(model)


def test_no_jitter_noise_does_not_warn_in_training_mode():
    _calibrates_without_warning(_mixtral(0.0).train())


def _phimoe(router_jitter: float):
    torch.manual_seed(0)
    config = transformers.PhimoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                                       num_experts_per_tok=2, max_position_embeddings=32,
                                       router_jitter_noise=router_jitter, input_jitter_noise=0.0, attention_dropout=0.0)
    return transformers.PhimoeForCausalLM(config)


def test_phimoe_router_sampling_experts_in_training_mode_warns_naming_the_router():
    # PhiMoE's router (sparsemixer) samples each token's experts among those within
    # 2 * router_jitter_noise of its best while training, with no dropout module nor input noise
    model = _phimoe(0.1).train()
    ids = _batches()[0]["input_ids"]
    with torch.no_grad():
        torch.manual_seed(0)
        assert any(not torch.equal(model(ids).logits, model(ids).logits) for _ in range(3))
        model.eval()
        assert torch.equal(model(ids).logits, model(ids).logits)
    model.train()
    with pytest.warns(UserWarning, match=r"calibrate: module 'model.layers.0.mlp.router' \(PhimoeTopKRouter\) is "
                                         r"in training mode"):
        qstats.calibrate(model, _batches(), RECIPE, progress=False)
    model.eval()
    _calibrates_without_warning(model)


def test_phimoe_router_without_jitter_routes_as_in_eval_mode_and_does_not_warn():
    model = _phimoe(0.0).train()
    ids = _batches()[0]["input_ids"]
    with torch.no_grad():  # no jitter: each token's best experts, as in eval mode
        training = model(ids).logits
        assert torch.equal(training, model.eval()(ids).logits)
    _calibrates_without_warning(model.train())
