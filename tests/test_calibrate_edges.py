"""Edges of qstats.calibrate / observing / compute_qparams_tree as a demanding user meets them:
activation checkpointing in a training loop, trees holding part of a model's sites. Statistics are
compared with torch.ao observers fed by hooks written here on a model run without the feature."""

import warnings

import pytest
import torch
from _shared import left_padded_qwen2_moe
from torch.ao.quantization.observer import MovingAverageMinMaxObserver

import qstats

transformers = pytest.importorskip("transformers")


def _tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    return config, transformers.LlamaForCausalLM(config)


def _copy(config, model):
    copy = transformers.LlamaForCausalLM(config)
    copy.load_state_dict(model.state_dict())
    return copy.train()


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_gradient_checkpointing_recomputation_is_not_observed_again(reentrant):
    """``observing`` in a training loop of a model with gradient checkpointing: backward recomputes
    each checkpointed layer's forward, whose hooks observed every activation twice (a moving average
    took two steps a batch, ``batches`` 6 after 3). States equal torch.ao observers fed by plain hooks
    on the same model run without checkpointing."""
    config, base = _tiny_llama()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), observer=qstats.moving_average_minmax,
                                        spec=qstats.QuantSpec(dtype="uint8", mapping="asymmetric"),
                                        observer_kwargs={"averaging_constant": 0.1})], ignore=["lm_head"])
    batches = [torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    reference, observers, handles = _copy(config, base), {}, []
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            observers[name] = MovingAverageMinMaxObserver(averaging_constant=0.1, dtype=torch.quint8)
            handles.append(module.register_forward_pre_hook(lambda m, a, name=name: observers[name](a[0].detach())))
    for ids in batches:
        reference(input_ids=ids, labels=ids).loss.backward()
    model = _copy(config, base)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers: use_cache=True is incompatible with checkpointing
        with qstats.observing(model, recipe) as session:
            for ids in batches:
                model(input_ids=ids, labels=ids).loss.backward()
    assert session.calls == 3 and sorted(session.states) == sorted(observers)
    for name, observer in observers.items():
        state = session.states[name]["input"]
        assert int(state.batches) == 3, name
        assert torch.equal(state.min_val, observer.min_val) and torch.equal(state.max_val, observer.max_val), name


def test_fused_groups_absent_from_the_tree_do_not_warn():
    """``compute_qparams_tree`` of part of a model's states (one layer's, as the layerwise pipelines
    pass; or the activations only) warned, for each fused NVFP4 group whose weights the tree does not
    hold, that its members 'each keep their own global scale' (they have no QParams at all). The
    layer's weights still share llm-compressor's fused global scale: the full tree's, and the smallest
    member's ``448 * 6 / amax`` (compressed-tensors' ``generate_gparam`` over the group's amax)."""
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    config, model = _tiny_llama()
    model.eval()
    recipe = qstats.Recipe.from_scheme("NVFP4", ignore=["lm_head"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        states = qstats.calibrate(model, [{"input_ids": torch.randint(0, 64, (1, 6))}], recipe, progress=False)
    full = qstats.compute_qparams_tree(states, recipe, model)
    layer = {path: entry for path, entry in states.items() if path.startswith("model.layers.0.")}
    inputs = {path: {"input": entry["input"]} for path, entry in states.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        part = qstats.compute_qparams_tree(layer, recipe, model)
        qstats.compute_qparams_tree(inputs, recipe, model)
    qkv = [f"model.layers.0.self_attn.{name}_proj" for name in "qkv"]
    amax = torch.stack([model.get_submodule(path).weight.detach().abs().max() for path in qkv]).max()
    expected = generate_gparam(-amax.reshape(1), amax.reshape(1))
    for path in qkv:
        assert torch.equal(part[path]["weight"].global_scale, full[path]["weight"].global_scale)
        assert torch.equal(part[path]["weight"].global_scale.reshape(1).float(), expected.float())


def test_padding_is_left_out_of_tokens_flattened_to_rows():
    """Qwen2-MoE's sparse block runs its shared expert and its gate on ``hidden_states.view(-1,
    hidden)``: a ``(batch, tokens)`` observation weight fitted no such ``[batch * tokens, hidden]``
    input, so its (left) padding was observed silently, since other sites took the weight. Each
    Linear's input equals a torch.ao observer fed by plain hooks the unpadded tokens only."""
    from torch.ao.quantization.observer import MinMaxObserver

    model, batch, mask = left_padded_qwen2_moe(layers=2)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec(dtype="uint8", mapping="asymmetric"))],
                           ignore=["lm_head"])
    states = qstats.calibrate(model, [batch], recipe, progress=False, observation_weight=lambda b: b["attention_mask"])
    observers, handles = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            observers[name] = MinMaxObserver(dtype=torch.quint8)

            def feed(module, args, name=name):
                x = args[0]
                observers[name](x[mask != 0] if x.ndim == 3 else x[mask.reshape(-1) != 0])

            handles.append(module.register_forward_pre_hook(feed))
    with torch.no_grad():
        model(**batch)
    assert "model.layers.0.mlp.shared_expert.down_proj" in observers
    for name, observer in observers.items():
        state = states[name]["input"]
        assert torch.equal(state.min_val, observer.min_val) and torch.equal(state.max_val, observer.max_val), name


def test_qparams_of_another_shape_are_named_by_module_and_site():
    """QParams of the wrong shape for a site (a tree keyed to the wrong modules, or from another
    model) raised fake_quantize's bare 'qparams of shape (6,) do not match ...' from inside the
    forward, naming neither the module nor the site."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4)).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight", "input"),
                                        spec=qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(-1)))])
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [torch.randn(3, 8)], recipe, progress=False),
                                          recipe, model)
    swapped = {"2": {"weight": qparams["0"]["weight"]}}  # 8 input channels where module 2 has 6
    with pytest.raises(ValueError, match=r"fake_quantized: module '2' parameter 'weight': qparams of shape \(8,\)"):
        with qstats.fake_quantized(model, swapped, recipe):
            model(torch.randn(3, 8))
    swapped = {"2": {"input": qparams["0"]["input"]}}
    with pytest.raises(ValueError, match=r"fake_quantized: module '2' site 'input': qparams of shape \(8,\)"):
        with qstats.fake_quantized(model, swapped, recipe):
            model(torch.randn(3, 8))
    assert [name for name, _ in model.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert not model[2]._forward_pre_hooks


def test_functional_attention_dropout_in_training_mode_warns():
    """transformers' Llama-family attention applies ``attention_dropout`` through the attention
    function while ``self.training``, with no ``nn.Dropout`` module: a model built from a config (in
    training mode) calibrated on randomly dropped-out attention without the training-mode warning."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.3,
                                      attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config)
    assert not any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    ids = torch.randint(0, 64, (2, 6))
    with torch.no_grad():  # training mode is random: the warning is due
        assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",))], ignore=["lm_head"])
    with pytest.warns(UserWarning, match=r"module 'model.layers.0.self_attn' \(LlamaAttention\) is in training mode"):
        qstats.calibrate(model, [ids], recipe, progress=False)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qstats.calibrate(model, [ids], recipe, progress=False)


@pytest.mark.parametrize("weight", [torch.ones(2, 4), 1.0], ids=["tensor", "number"])
def test_an_observation_weight_that_is_not_callable_is_named(weight):
    # an attention mask given itself, not a function of the batch: "'Tensor' object is not callable"
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",))])
    with pytest.raises(TypeError, match="calibrate: observation_weight must be a callable"):
        qstats.calibrate(model, [torch.randn(2, 4)], recipe, progress=False, observation_weight=weight)
