"""`qstats.coreai_opt.recipe_from_coreai_opt` against coreai_opt's eager ``Quantizer``: the sites
its ``prepare`` quantizes (by global, type and name configs, disabled ones left out) are the
recipe's, and after ``prepare(example)`` and ``calibration_mode()`` over the same batches, its
calculators' scales and zero points equal `compute_qparams_tree` of `qstats.calibrate` run the same
way (the example on the float model, then the batches with the weights fake-quantized), bit for bit."""

import copy
import warnings

import pytest
import torch
from torch import nn

import qstats
import qstats.coreai_opt

pytest.importorskip("coreai_opt")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from coreai_opt.quantization import ExecutionMode, ModuleQuantizerConfig, Quantizer, QuantizerConfig
    from coreai_opt.quantization.config.quantization_config import OpQuantizerConfig
    from coreai_opt.quantization.spec.fake_quantize import FakeQuantizeImplBase
    from coreai_opt.quantization.spec.spec import QuantizationSpec

EAGER = ExecutionMode.EAGER


class _Averaged(QuantizationSpec):
    """A QuantizationSpec whose moving average steps by 0.25 (coreai_opt passes extra fields to its
    calculator)."""

    averaging_constant: float = 0.25


class _Tempered(QuantizationSpec):
    temperature: float = 2.0
WEIGHT_SITES = ("weight", "bias")


def _coreai_opt_calibrated(model, config, example, batches) -> tuple:
    """coreai_opt's model after its prepare on ``example`` and calibration on ``batches``, and
    ``{path: {site: calculator}}`` of its quantizers."""
    quantizer = Quantizer(copy.deepcopy(model), config)
    prepared = quantizer.prepare((example,))
    with quantizer.calibration_mode(), torch.no_grad():
        for batch in batches:
            prepared(batch)
    out: dict = {}
    for node in getattr(getattr(prepared, "graph", None), "nodes", ()):  # graph mode: weights' quantizers
        module = prepared.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(module, FakeQuantizeImplBase) and node.args[0].op == "get_attr":
            path, _, site = node.args[0].target.rpartition(".")
            out.setdefault(path, {})[site] = module.qparams_calculator
    for path, module in prepared.named_modules():
        if ".parametrizations." in path:  # a weight's fake quantizer, read from its owner below
            continue
        for name, child in module.named_children():
            if isinstance(child, FakeQuantizeImplBase) and "_quantize_" in name:  # eager: <op>_quantize_...
                site = "output" if "_quantize_output" in name else "input"
                out.setdefault(path, {})[site] = child.qparams_calculator
        for name, parametrizations in getattr(module, "parametrizations", {}).items():
            for child in parametrizations:
                if isinstance(child, FakeQuantizeImplBase):
                    out.setdefault(path, {})[name] = child.qparams_calculator
    return prepared, out


def _qstats_qparams(model, plan, example, batches) -> dict:
    """`compute_qparams_tree` after the example on the float model and the batches inside
    `qstats.fake_quantized` with the weights' qparams (coreai_opt's calibration_mode)."""
    states = qstats.calibrate(model, [example], plan, progress=False)
    weights = {path: {site: qp for site, qp in entry.items() if site in WEIGHT_SITES}
               for path, entry in qstats.compute_qparams_tree(states, plan).items()}
    with qstats.fake_quantized(model, weights, plan):
        states = qstats.calibrate(model, batches, plan, states=states, progress=False)
    return qstats.compute_qparams_tree(states, plan)


def _compare(model, config, example, batches) -> tuple:
    """(equal qparams, all qparams), after asserting both quantize the same sites and that the
    model inside `qstats.fake_quantized` gives coreai_opt's prepared model's outputs on a new
    batch. A ``"dynamic"`` activation has no calibrated qparams in qstats (None: each tensor's own)."""
    prepared, expected = _coreai_opt_calibrated(model, config, example, batches)
    plan = qstats.coreai_opt.recipe_from_coreai_opt(config, model).resolve(model)
    got = _qstats_qparams(model, plan, example, batches)
    assert expected and {p: sorted(e) for p, e in got.items()} == {p: sorted(e) for p, e in expected.items()}
    equal = total = 0
    for path, entry in expected.items():
        for site, calculator in entry.items():
            qp, scale, zero_point = got[path][site], calculator.scale, calculator.zero_point
            if qp is None:
                assert type(calculator).__name__ == "DynamicQParamsCalculator"
                continue
            assert scale.numel() == qp.scale.numel(), (path, site)
            equal += torch.equal(qp.scale, scale.reshape(qp.scale.shape).to(qp.scale.dtype))
            total += 1
            if zero_point is not None:  # None: a float target's
                equal += torch.equal(qp.zero_point, zero_point.reshape(qp.zero_point.shape).to(qp.zero_point.dtype))
                total += 1
    new_batch = batches[-1].flip(0)
    with torch.no_grad(), qstats.fake_quantized(model, got, plan):
        assert torch.equal(model(new_batch), prepared(new_batch))
    return equal, total


def _data(features, shape=(), count=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    example = torch.randn(2, features, *shape, generator=g).to(dtype)
    return example, [(torch.randn(3, features, *shape, generator=g) * (i + 1)).to(dtype) for i in range(count)]


def _linear_stack(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 8), nn.Sigmoid(), nn.Linear(8, 4)).to(dtype).eval()


def _spec(dtype=torch.int8, qscheme="symmetric", granularity=None, calculator="default", **fields):
    return QuantizationSpec(dtype=dtype, qscheme=qscheme, granularity=granularity or {"type": "per_tensor"},
                            qparam_calculator_cls=calculator, **fields)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_default_config_on_a_linear_stack(dtype, single_thread_quiet):
    """coreai_opt's default config: int8 per-channel weights, int8 moving-average inputs and outputs."""
    model = _linear_stack(dtype)
    equal, total = _compare(model, QuantizerConfig(execution_mode=EAGER), *_data(16, dtype=dtype))
    assert equal == total == 2 * 9


def test_type_overrides_and_a_module_disabled_by_name_on_a_conv_stack(single_thread_quiet):
    """Conv2d weights int4 per block (axis None: coreai_opt's input channel), Linear weights uint8
    asymmetric per channel with global min-max inputs, the middle conv disabled by name."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.ReLU(), nn.Conv2d(8, 4, 3),
                          nn.Flatten(), nn.Linear(4 * 2 * 2, 6)).eval()
    conv = ModuleQuantizerConfig(
        op_state_spec={"weight": _spec(torch.int4, granularity={"type": "per_block", "block_size": 4})},
        op_input_spec={0: _spec(torch.uint8, "asymmetric", calculator="moving_average")}, op_output_spec=None)
    linear = ModuleQuantizerConfig(
        op_state_spec={"weight": _spec(torch.uint8, "asymmetric", {"type": "per_channel", "axis": 0})},
        op_input_spec={"*": _spec(calculator="global_minmax")}, op_output_spec=None)
    config = QuantizerConfig(global_config=None, execution_mode=EAGER,
                             module_type_configs={nn.Conv2d: conv, nn.Linear: linear}, module_name_configs={"2": None})
    equal, total = _compare(model, config, *_data(4, (6, 6)))
    assert equal == total == 2 * 6  # weight and input of convs 0 and 4 and of the Linear


@pytest.mark.parametrize("disabled_last", [False, True])
def test_name_patterns_pass_to_children_and_the_last_wins(disabled_last, single_thread_quiet):
    """A name pattern matching a container configures its children over their type config; of two
    patterns naming one module the later applies, whichever is more specific."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    model = nn.Sequential(block, nn.ReLU(), copy.deepcopy(block), nn.Linear(16, 4)).eval()
    int4 = ModuleQuantizerConfig(op_state_spec={"weight": _spec(torch.int4, granularity={"type": "per_channel"})},
                                 op_input_spec=None, op_output_spec=None)
    asymmetric = ModuleQuantizerConfig(
        op_state_spec={"weight": _spec(torch.int8, "asymmetric", {"type": "per_channel", "axis": 0})},
        op_input_spec={0: _spec(torch.uint8, "asymmetric")}, op_output_spec=None)
    names = [("0|2", int4), ("2\\.2", None)] if disabled_last else [("2\\.2", None), ("0|2", int4)]
    config = QuantizerConfig(execution_mode=EAGER, global_config=None, module_type_configs={nn.Linear: asymmetric},
                             module_name_configs=dict(names))
    recipe = qstats.coreai_opt.recipe_from_coreai_opt(config, model)
    sites = {path: sorted(entry) for path, entry in recipe.sites(model).items()}
    assert sites == {"0.0": ["weight"], "0.2": ["weight"], "2.0": ["weight"], "3": ["input", "weight"],
                     **({} if disabled_last else {"2.2": ["weight"]})}
    equal, total = _compare(model, config, *_data(16))
    assert equal == total == 2 * (6 - disabled_last)


def test_state_star_quantizes_bias_and_float_range_pins_an_end(single_thread_quiet):
    """``op_state_spec={"*": ...}`` quantizes weight and bias (per tensor); an int4 asymmetric
    weight with its maximum pinned by ``float_range``."""
    model = _linear_stack()
    pinned = _spec(torch.int4, "asymmetric", {"type": "per_channel", "axis": 0}, float_range=[None, 0.2])
    linear = OpQuantizerConfig(op_state_spec={"weight": pinned, "*": _spec()}, op_input_spec=None, op_output_spec=None)
    config = QuantizerConfig(execution_mode=EAGER, global_config=ModuleQuantizerConfig(
        op_type_config={"linear": linear}, op_input_spec=None, op_output_spec=None, op_state_spec=None))
    recipe = qstats.coreai_opt.recipe_from_coreai_opt(config, model)
    assert {site for rule in recipe.rules for site in rule.sites} == {"weight", "bias"}
    equal, total = _compare(model, config, *_data(16))
    assert equal == total == 2 * 6


def test_module_level_specs_of_linear_modules_override_their_op_specs(single_thread_quiet):
    """``module_state_spec`` / ``module_input_spec`` / ``module_output_spec`` of a Linear type
    config apply to the Linears' weight, input and output over the op-level specs (a None one
    disables); a container's are refused (see the refusals)."""
    model = _linear_stack()
    config = QuantizerConfig(execution_mode=EAGER, module_type_configs={nn.Linear: ModuleQuantizerConfig(
        op_state_spec={"weight": _spec()}, op_output_spec={0: _spec()},
        module_state_spec={"weight": _spec(torch.int4, "asymmetric", {"type": "per_channel", "axis": 0})},
        module_input_spec={0: _spec(torch.uint8, "asymmetric", calculator="global_minmax")},
        module_output_spec={"*": None})})
    recipe = qstats.coreai_opt.recipe_from_coreai_opt(config, model)
    assert {site: rule.spec.dtype for rule in recipe.rules for site in rule.sites} == {"weight": "int4", "input": "uint8"}
    equal, total = _compare(model, config, *_data(16))
    assert equal == total == 2 * 6


def test_graph_mode_weight_preset(single_thread_quiet):
    """coreai_opt's weight-only preset w4_per_block (graph execution mode, axis None resolved to the
    input channel)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 64)).eval()
    equal, total = _compare(model, QuantizerConfig.presets.w4_per_block(), *_data(64))
    assert equal == total == 2 * 2


class _EmbedUpPool(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.up = nn.ConvTranspose1d(8, 4, 3)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, ids):
        return self.pool(self.up(self.embed(ids).transpose(1, 2))[:, None])


def test_embedding_conv_transpose_and_pooling(single_thread_quiet):
    """Under the default config, an Embedding's weight and output (its indices are not quantized)
    and a pooling module's input and output; a ConvTranspose1d's weight per channel with axis None
    (preset w8), which coreai_opt resolves to its axis 1."""
    torch.manual_seed(0)
    model = _EmbedUpPool().eval()
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 10, (3, 5), generator=g) for _ in range(4)]
    config = QuantizerConfig(execution_mode=EAGER, module_type_configs={nn.ConvTranspose1d: ModuleQuantizerConfig.presets.w8()})
    recipe = qstats.coreai_opt.recipe_from_coreai_opt(config, model)
    assert recipe.sites(model)["up"]["weight"].spec.granularity == qstats.PerAxis(1)
    equal, total = _compare(model, config, batches[0], batches[1:])
    assert equal == total == 2 * 5  # embed weight and output, up weight, pool input and output


SPECS = {
    "per_channel_activations": (_spec(granularity={"type": "per_channel", "axis": 0}),
                                _spec(granularity={"type": "per_channel", "axis": -1}, calculator="global_minmax")),
    "int4_per_block_dynamic_activations": (_spec(torch.int4, granularity={"type": "per_block", "block_size": 16}),
                                           _spec(torch.uint8, "asymmetric", calculator="dynamic")),
    "fp8": (_spec(torch.float8_e4m3fn, granularity={"type": "per_channel", "axis": 0}), _spec(torch.float8_e4m3fn)),
    "int8_e8m0_blocks": (_spec(granularity={"type": "per_block", "block_size": 32}, scale_dtype=torch.float8_e8m0fnu),
                         None),
    "symmetric_with_clipping": (_spec(qscheme="symmetric_with_clipping", granularity={"type": "per_channel"}),
                                _spec(qscheme="symmetric_with_clipping")),
}


@pytest.mark.parametrize("case", list(SPECS))
def test_weight_and_activation_specs(case, single_thread_quiet):
    weight, activation = SPECS[case]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 64)).eval()
    config = QuantizerConfig(execution_mode=EAGER, global_config=ModuleQuantizerConfig(
        op_state_spec={"weight": weight}, op_input_spec={0: activation}, op_output_spec={0: activation}))
    equal, total = _compare(model, config, *_data(64))
    assert equal == total


def _refusals() -> dict:
    from coreai_opt.quantization.config.quantization_config import KVCacheQuantConfig

    weights = {"weight": _spec(granularity={"type": "per_channel", "axis": 0})}
    linear = OpQuantizerConfig(op_state_spec=weights, op_input_spec=None, op_output_spec=None)
    cache = KVCacheQuantConfig(op_quantizer_config=OpQuantizerConfig(op_input_spec={1: _spec()}, op_output_spec=None,
                                                                     op_state_spec=None))

    def eager(**fields):
        return QuantizerConfig(execution_mode=EAGER, global_config=ModuleQuantizerConfig(**fields))

    return {
        "op_name_config": eager(op_name_config={"linear_0": linear}),
        "module '' .Sequential. has module-level specs": QuantizerConfig(
            execution_mode=EAGER, module_type_configs={nn.Sequential: ModuleQuantizerConfig(module_state_spec=weights)}),
        "kv_cache_quant_configs": QuantizerConfig(kv_cache_quant_configs={"cache_update": cache},
                                                  global_config=ModuleQuantizerConfig.presets.w8()),
        "graph execution mode": QuantizerConfig(),
        "'add'": eager(op_type_config={"add": OpQuantizerConfig()}),
        "qformulation 'minval'": eager(op_state_spec={"weight": _spec(qformulation="minval")}),
        "per-block activations": eager(op_input_spec={0: _spec(granularity={
            "type": "per_block", "axis": -1, "block_size": 8})}),
        "axis None": eager(op_state_spec={"*": _spec(granularity={"type": "per_channel"})}),
        "spec field.s. \\['temperature'\\] of _Tempered": eager(op_input_spec={0: _Tempered(dtype=torch.int8)}),
    }


@pytest.mark.parametrize("option", list(_refusals()))
def test_options_a_recipe_cannot_hold_are_refused_by_name(option, single_thread_quiet):
    model = _linear_stack()
    with pytest.raises(ValueError, match=option):
        qstats.coreai_opt.recipe_from_coreai_opt(_refusals()[option], model)


def test_a_config_dict_is_refused():
    with pytest.raises(TypeError, match="QuantizerConfig.from_dict"):
        qstats.coreai_opt.recipe_from_coreai_opt({"quantization_config": {}}, _linear_stack())


def _original(name: str) -> str:
    """The float model's name of a parameter of coreai_opt's parametrized model."""
    return name.replace("parametrizations.weight.original", "weight")


def test_qat_with_the_converted_observers_and_schedule_equals_coreai_opts(single_thread_quiet):
    """coreai_opt's eager QAT under a config with a ``QATSchedule``, against `qstats.qat.prepare`
    with the observers of the recipe `recipe_from_coreai_opt` gives and the schedule
    `schedule_from_coreai_opt` gives: forward and gradients bit for bit, step for step."""
    from coreai_opt.quantization.config import QATSchedule

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    linear = OpQuantizerConfig(op_input_spec={0: _spec(torch.uint8, "asymmetric", calculator="moving_average")},
                               op_state_spec={"weight": _spec(torch.int4, granularity={"type": "per_channel"})},
                               op_output_spec={0: None})
    config = QuantizerConfig(execution_mode=EAGER, global_config=ModuleQuantizerConfig(
        op_type_config={"linear": linear}, qat_schedule=QATSchedule(enable_observer=0, enable_fake_quant=1,
                                                                    disable_observer=3)))
    weight_rule, input_rule = qstats.coreai_opt.recipe_from_coreai_opt(config, model).rules
    assert (weight_rule.sites, input_rule.sites) == (("weight",), ("input",))
    schedule = qstats.coreai_opt.schedule_from_coreai_opt(config, model)
    assert schedule == qstats.QATSchedule(observe_at=0, fake_quantize_at=1, freeze_ranges_at=3)
    quantizer = Quantizer(copy.deepcopy(model), config)
    example = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))
    reference = quantizer.prepare((example,))
    qat = qstats.qat.prepare(model, weight_rule.make_observer(), input_rule.make_observer())
    _, state = qat.apply(qat.params(), qat.init(example), example, phase=qstats.QATPhase(fake_quantize=False))

    def loss_fn(params, state, x, phase):
        out, new_state = qat.apply(params, state, x, phase=phase)
        return out.square().mean(), (new_state, out)

    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    with quantizer.training_mode():
        for step in range(5):
            x = torch.randn(3, 16, generator=g) * (step + 1)
            params = {_original(name): p.detach().clone() for name, p in reference.named_parameters()}
            optimizer.zero_grad()
            expected = reference(x)
            expected.square().mean().backward()
            grads, (state, out) = torch.func.grad(loss_fn, has_aux=True)(params, state, x, schedule(step))
            assert torch.equal(out, expected.detach())
            for name, p in reference.named_parameters():
                assert torch.equal(grads[_original(name)], p.grad)
            optimizer.step()
            quantizer.step()


def test_different_qat_schedules_are_refused_naming_the_modules():
    from coreai_opt.quantization.config import QATSchedule

    late = ModuleQuantizerConfig.presets.w8()
    late.qat_schedule = QATSchedule(enable_observer=2, enable_fake_quant=2)
    config = QuantizerConfig(execution_mode=EAGER, global_config=ModuleQuantizerConfig.presets.w8(),
                             module_name_configs={"2": late})
    assert qstats.coreai_opt.schedule_from_coreai_opt(config, nn.Sequential(nn.Linear(4, 4))) == qstats.QATSchedule()
    with pytest.raises(ValueError, match="modules '0' and '2' have different qat_schedule"):
        qstats.coreai_opt.schedule_from_coreai_opt(config, _linear_stack())


def test_a_weight_its_blocks_do_not_divide_is_left_unquantized_with_a_warning(single_thread_quiet):
    """coreai_opt's prepare leaves a weight whose size along the block axis the block does not
    divide unquantized (and logs it); the recipe leaves it out and warns, naming it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 3)).eval()
    config = QuantizerConfig.presets.w4_per_block(block_size=4, execution_mode=EAGER)
    with pytest.warns(UserWarning, match="module '2' weight: block size 4 does not divide"):
        equal, total = _compare(model, config, *_data(16))
    assert equal == total == 2


def test_per_channel_activations_of_convs_and_pooling_and_pinned_3d_linear_inputs(single_thread_quiet):
    """uint8 activations per channel (axis 1 of NCHW) on convs and a MaxPool2d; int8 per-feature
    inputs of Linears on [batch, sequence, features] tensors with their minimum pinned."""
    torch.manual_seed(0)
    convs = nn.Sequential(nn.Conv2d(4, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 4, 1)).eval()
    per_channel = _spec(torch.uint8, "asymmetric", {"type": "per_channel", "axis": 1}, calculator="moving_average")
    config = QuantizerConfig(execution_mode=EAGER, global_config=ModuleQuantizerConfig(
        op_input_spec={"*": per_channel}, op_output_spec={"*": per_channel}))
    equal, total = _compare(convs, config, *_data(4, (6, 6)))
    assert equal == total == 2 * 8  # both convs' weight, input and output, the pool's input and output
    linears = nn.Sequential(nn.Linear(16, 8), nn.GELU(), nn.Linear(8, 4)).eval()
    pinned = _spec(granularity={"type": "per_channel", "axis": -1}, calculator="global_minmax", float_range=[-1.0, None])
    config = QuantizerConfig(execution_mode=EAGER, global_config=ModuleQuantizerConfig(
        op_input_spec={"*": pinned}, op_output_spec=None))
    rules = qstats.coreai_opt.recipe_from_coreai_opt(config, linears).rules
    assert next(rule for rule in rules if rule.sites == ("input",)).qparams_kwargs == (("float_range", (-1.0, None)),)
    equal, total = _compare(linears, config, *_data(5, (16,)))
    assert equal == total == 2 * 4


def test_a_spec_subclass_with_an_averaging_constant(single_thread_quiet):
    model = _linear_stack()
    averaged = _Averaged(dtype=torch.uint8, qscheme="asymmetric", qparam_calculator_cls="moving_average")
    config = QuantizerConfig(execution_mode=EAGER, global_config=ModuleQuantizerConfig(
        op_input_spec={0: averaged}, op_output_spec=None))
    rules = qstats.coreai_opt.recipe_from_coreai_opt(config, model).rules
    assert next(rule for rule in rules if rule.sites == ("input",)).observer_kwargs == (("averaging_constant", 0.25),)
    equal, total = _compare(model, config, *_data(16))
    assert equal == total == 2 * 6


def test_a_spec_subclass_field_is_refused_also_on_a_weight_left_unquantized(single_thread_quiet):
    """A subclass's fields reach the components coreai_opt's factory builds (get_extra_args), which qstats
    cannot know: refused by name on every site, a weight whose blocks do not divide it included (the
    recipe returned before from_coreai_opt refused them there)."""
    tempered = _Tempered(dtype=torch.int4, granularity={"type": "per_block", "axis": 1, "block_size": 4})
    config = QuantizerConfig(execution_mode=EAGER, global_config=ModuleQuantizerConfig(
        op_state_spec={"weight": tempered}, op_input_spec=None, op_output_spec=None))
    with pytest.raises(ValueError, match=r"module '0' weight: .*\['temperature'\] of _Tempered"):
        qstats.coreai_opt.recipe_from_coreai_opt(config, nn.Sequential(nn.Linear(5, 3)))
