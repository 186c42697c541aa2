"""Stacked experts (3-D ``gate_up_proj [E, 2I, H]`` or gate-less ``up_proj [E, I, H]``, ``down_proj
[E, H, I]``) unpacked into per-expert Linear entries ``<path>.<e>.gate_proj`` / ``up_proj`` /
``down_proj``, as llm-compressor's ``LinearExperts2D`` unpacks them (``gate_up_proj[e, :I]`` is gate).
Llama 4's and GPT-OSS' stacks, stored transposed (GPT-OSS' gate and up interleaved, with biases), are
read through their `qstats.experts.StackLayout`, as llm-compressor's registered linear experts read
them; other transposed or interleaved stacks are refused. So that vLLM's fused-MoE loader and
transformers read them. See docs/export.md.
"""

from __future__ import annotations

import json
from typing import Mapping, Optional

import torch

from .._granularity import PerBlock, PerTensor, TensorGroup, qparam_shape
from .._qparams import QParams, experts_qparams, per_expert_qparams
from .._spec import QuantSpec
from ..experts import linearized_layout_problem, own_parameters, stack_layout
from .config import fail
from .linear import Entry
from .scales import check_qparams, scale_dtype
from .._warn import warn
from ._categories import ExportWarning, UnloadedExpertsWarning

__all__ = ["expert_entries", "unpack_loaded_per_expert", "warn_mixed_experts", "warn_unloaded_experts"]

_INPUT_SITES = ("input", "gate_up_proj.input", "up_proj.input", "down_proj.input")
# experts that transformers swaps for per-expert Linears whenever it loads a compressed-tensors
# checkpoint, quantized or not (its MODULES_TO_PATCH_FOR_QUANTIZATION: SequentialLlama4TextExperts)
_LOADED_PER_EXPERT = ("Llama4TextExperts",)


def fill_uncovered_experts(qp: Optional[QParams], spec: Optional[QuantSpec] = None) -> Optional[QParams]:
    """Per-expert activation qparams where experts that saw no token take those of the covered expert with
    the largest scale (NVFP4: the smallest global scale), since vLLM's fused MoE applies the largest input
    scale (smallest global scale) of all experts to every expert. ``calibrated`` is unchanged.
    """
    if qp is None or qp.scale.dim() < 1:
        return qp
    two_level = spec is not None and isinstance(spec.granularity, TensorGroup)
    per_entry = qp.calibrated.reshape(qp.calibrated.shape[0], -1)
    covered = per_entry.any(-1) if two_level else per_entry.all(-1)
    if bool(covered.all()) or not bool(covered.any()):
        return qp
    if two_level:
        per_expert = -qp.global_scale.reshape(qp.global_scale.shape[0], -1).amax(-1).float()
    else:
        per_expert = qp.scale.reshape(qp.scale.shape[0], -1).amax(-1)
    donor = int(torch.where(covered, per_expert, -torch.inf).argmax())

    def fill(field):
        if field is None or field.dim() < 1 or field.shape[0] != covered.shape[0]:
            return field
        keep = covered.reshape(-1, *([1] * (field.dim() - 1)))
        return torch.where(keep, field, field[donor : donor + 1])

    # minval follows the scale and zero point it goes with
    filled = ("scale", "zero_point", "global_scale", "minval")
    return qp._replace(**{name: fill(getattr(qp, name)) for name in filled})


def _row_slice(qp: QParams, spec: QuantSpec, start: int, stop: int, where: str) -> QParams:
    """The qparams of rows ``start:stop`` of a weight whose qparams are ``qp`` (one expert); its global
    scale, one for the whole weight (``()`` or compressed-tensors' ``(1,)``), is every row's."""
    granularity = spec.granularity
    if isinstance(granularity, PerTensor):
        return qp
    if isinstance(granularity, PerBlock):
        rows = granularity.block_shape[0]
        if start % rows or stop % rows:
            fail(where, f"rows {start}:{stop} of the fused weight do not fall on {granularity!r} block boundaries")
        start, stop = start // rows, stop // rows
    return QParams(*(field[start:stop] if field is not None and field.dim() >= 1 and name != "global_scale"
                     else field for name, field in zip(qp._fields, qp)))


def _check_rows(qp: Optional[QParams], spec: Optional[QuantSpec], shape: tuple, where: str) -> None:
    """ValueError naming ``where`` unless the stacked qparams ``qp`` (``[E, ...]``) have the rows ``spec``
    gives a weight of per-expert ``shape``: gate and up rows cut from the qparams of a stack of other
    rows (another intermediate size) pass each projection's own checks and write wrong scales."""
    if qp is None or spec is None or isinstance(spec.granularity, PerTensor) or qp.scale.dim() < 2:
        return
    try:
        rows = qparam_shape(shape, spec.granularity)[:1]
    except ValueError:  # a granularity that does not fit the weight: each projection's own checks name it
        return
    if rows and qp.scale.shape[1] != rows[0]:
        fail(where, f"qparams of scale shape {tuple(qp.scale.shape)} are not those of a stack of per-expert "
             f"weights {shape} under {spec.granularity!r} ({rows[0]} rows per expert)")


def _whole_block(qp: QParams, spec: QuantSpec, shape: tuple) -> tuple:
    """``(qp, spec)`` of one projection; a PerBlock whose one block is the whole projection as
    PerTensor: llm-compressor's per-tensor ``gate_proj``/``up_proj``, each its own scale, of a fused
    ``gate_up_proj [E, 2I, H]`` observed in ``PerBlock((I, H))`` halves (not ``partial``: a
    compressed-tensors block spec, FP8_BLOCK's, keeps its one block as llm-compressor does)."""
    granularity = spec.granularity
    if not (isinstance(granularity, PerBlock) and not granularity.partial
            and tuple(granularity.block_shape) == tuple(shape)):
        return qp, spec
    return QParams(*(None if f is None else f.reshape(()) for f in qp)), spec.replace(granularity=PerTensor())


def _refuse_layout(path: str, module: torch.nn.Module, params: dict, first: str) -> None:
    """ValueError naming ``path`` for experts whose per-expert Linears qstats cannot cut from their
    stacks (`linearized_layout_problem`: transposed or interleaved stacks of other experts than
    Llama 4's and GPT-OSS'), or with parameters beyond the stacked weights and the biases their
    `StackLayout` names."""
    problem = linearized_layout_problem(module)
    if problem:
        fail(path, f"stacked experts are not exportable: {problem}")
    biases = {getattr(stack_layout(module, name), "bias", None) for name in (first, "down_proj")}
    others = sorted(name for name in params if name not in (first, "down_proj") and name not in biases)
    if others:  # they would be dropped with the fused parameters
        fail(path, f"stacked experts are not exportable: it has other parameters ({', '.join(others)}), e.g. "
             "biases, that no exported tensor holds")


def _canonical(module: torch.nn.Module, params: dict, name: str) -> Optional[torch.Tensor]:
    """Parameter ``name`` (detached) as the per-expert Linear weights ``[E, out, in]`` (`stack_layout`)."""
    param, layout = params.get(name), stack_layout(module, name)
    if param is None or param.dim() != 3 or layout is None:
        return None if param is None else param.detach()
    return layout.canonical(param.detach())


def _canonical_biases(module: torch.nn.Module, params: dict, first: str) -> dict:
    """``{stack name: bias [E, out]}`` of the stacks whose `StackLayout` names a bias (GPT-OSS), in
    the order of the per-expert Linears' rows (gate, then up)."""
    biases = {}
    for name in (first, "down_proj"):
        layout = stack_layout(module, name)
        if layout is not None and layout.bias is not None and layout.bias in params:
            biases[name] = layout.canonical_bias(params[layout.bias].detach())
    return biases


def _stacked_parameters(path: str, module: torch.nn.Module, sites: Mapping, num_experts: int) -> tuple:
    """``(first, up, down, biases, sites)``: the name of the first projection (``gate_up_proj [E, 2I, H]``,
    gate rows first, or gate-less ``up_proj [E, I, H]``), the stacks of an exportable experts module
    as the per-expert Linear weights (`_canonical`), their biases (`_canonical_biases`) and its sites'
    qparams with one global scale per expert (`per_expert_qparams`), after checking its layout, its
    sites and the leading expert dimension of their qparams. A parametrized stack (inside
    `qstats.fake_quantized`) is read as its float original (`own_parameters`)."""
    params = own_parameters(module)
    first = "gate_up_proj" if "gate_up_proj" in params else "up_proj"
    up, down = _canonical(module, params, first), _canonical(module, params, "down_proj")
    known = (first, "down_proj", "input", f"{first}.input", "down_proj.input")
    unknown = [site for site in sites if site not in known]
    if unknown:
        fail(f"{path}/{unknown[0]}", f"stacked experts with {first} export the sites {known}")
    if up is None or down is None or up.dim() != 3 or down.dim() != 3:
        fail(path, "stacked experts export needs 3-D gate_up_proj [E, 2I, H] (or up_proj [E, I, H]) and down_proj "
             "[E, H, I] parameters")
    _refuse_layout(path, module, params, first)
    rows = 2 * down.shape[2] if first == "gate_up_proj" else down.shape[2]
    if up.shape[1] != rows or down.shape[1] != up.shape[2]:
        fail(path, f"{first} {tuple(up.shape)} and down_proj {tuple(down.shape)} (as per-expert Linear weights) are "
             f"not the layout [E, {'2I' if first == 'gate_up_proj' else 'I'}, H] / [E, H, I]")
    stacked = dict(sites)
    for site, qp in sites.items():
        if qp is not None:
            try:  # a leading expert dimension; a shared global scale is repeated per expert
                stacked[site] = per_expert_qparams(check_qparams(qp, f"{path}/{site}"), num_experts)
            except ValueError as error:
                fail(f"{path}/{site}", str(error))
    return first, up, down, _canonical_biases(module, params, first), stacked


def expert_entries(path: str, module: torch.nn.Module, sites: Mapping, specs: Mapping, num_experts: int,
                   tensors: dict, dynamic=frozenset()) -> list:
    """Per-expert Linear entries of a stacked experts module; a projection without qparams is written
    unquantized into ``tensors``. ``dynamic``: activation sites whose scales come at run time.
    """
    first, up, down, biases, sites = _stacked_parameters(path, module, sites, num_experts)
    for name, stack in ((first, up), ("down_proj", down)):
        _check_rows(sites.get(name), specs.get(name), tuple(stack.shape[1:]), f"{path}/{name}")
    dtype = scale_dtype(up)
    # the routed hidden states: "<first>.input" equals "input"
    input_name = f"{first}.input" if f"{first}.input" in sites else "input"
    _check_one_input(path, sites, specs, ("input", f"{first}.input"))
    sites = {site: fill_uncovered_experts(qp, specs.get(site)) if site in _INPUT_SITES else qp
             for site, qp in sites.items()}

    def site(name: str, expert: int, where: Optional[str] = None) -> tuple:
        """The entry site ``(QParams, spec, where, dynamic)`` of stacked site ``name`` cut to ``expert``."""
        qp = experts_qparams(sites.get(name), expert)
        return qp, specs.get(name), where or f"{path}/{name}[{expert}]", name in dynamic

    entries = []
    for expert in range(num_experts):
        prefix = f"{path}.{expert}"
        inputs = {"input": site(input_name, expert)} if input_name in sites else {}
        if inputs and first not in sites:
            fail(f"{path}/{input_name}",
                 f"input scales of stacked experts need the {first} weights exported too")
        projections = []
        for name, (start, stop) in _up_rows(first, down.shape[2]):
            weight = up[expert, start:stop]
            if first in biases:  # as llm-compressor copies them into its Linears, never quantized
                tensors[f"{prefix}.{name}.bias"] = biases[first][expert, start:stop].contiguous()
            if first not in sites:  # unquantized: the float weights, unpacked like the quantized ones
                tensors[f"{prefix}.{name}.weight"] = weight.contiguous()
                continue
            qp, spec, where, _ = site(first, expert, f"{path}/{first}[{expert}] ({name})")
            if spec is not None and first == "gate_up_proj":
                qp = _row_slice(qp, spec, start, stop, where)
                qp, spec = _whole_block(qp, spec, (stop - start, up.shape[2]))
            projections.append((name, weight, {"weight": (qp, spec, where, False), **inputs}))
        if "down_proj" in biases:
            tensors[f"{prefix}.down_proj.bias"] = biases["down_proj"][expert].contiguous()
        if "down_proj" in sites:
            down_sites = {"weight": site("down_proj", expert)}
            # the intermediate activation act(gate) * up, quantized only by its own site: the routed input's
            # spec, dynamic or not, is not down_proj's (a checkpoint giving it down_proj too would quantize
            # what the recipe and `qstats.fake_quantized` leave float; `warn_mixed_experts` names vLLM's need)
            if "down_proj.input" in sites:
                down_sites["input"] = site("down_proj.input", expert)
            projections.append(("down_proj", down[expert], down_sites))
        elif "down_proj.input" in sites:
            fail(f"{path}/down_proj.input",
                 "input scales of down_proj need the down_proj weights exported too")
        else:
            tensors[f"{prefix}.down_proj.weight"] = down[expert].contiguous()
        entries += [Entry(f"{prefix}.{name}", weight, dtype, entry_sites, experts=(path, name))
                    for name, weight, entry_sites in projections]
    return entries


def _check_one_input(path: str, sites: Mapping, specs: Mapping, names: tuple) -> None:
    """ValueError naming both when the sites ``names`` (``"input"`` and ``"<first>.input"``: the same rows)
    hold other qparams or specs: `qstats.fake_quantized` quantizes the rows under each in turn, and a
    checkpoint holds one input scale per projection."""
    held = [name for name in names if sites.get(name) is not None]
    if len(held) < 2:
        return
    (a, b), (spec_a, spec_b) = (sites[n] for n in held), (specs.get(n) for n in held)
    same = spec_a == spec_b and all(
        (x is None) == (y is None) and (x is None or (x.shape == y.shape and torch.equal(x, y))) for x, y in zip(a, b))
    if not same:
        fail(f"{path}/{held[1]}", f"sites {held[0]!r} and {held[1]!r} both quantize the rows {held[1].split('.')[0]} "
             "multiplies, with other qparams or specs; qstats.fake_quantized applies both in turn, a checkpoint holds "
             "one input scale per projection: keep one of them")


def _up_rows(first: str, intermediate: int) -> tuple:
    """``(name, (start, stop))`` of the Linears cut from each expert's first stack: gate rows then
    up rows of ``gate_up_proj``, or all of a gate-less ``up_proj``."""
    if first == "up_proj":
        return (("up_proj", (0, intermediate)),)
    return ("gate_proj", (0, intermediate)), ("up_proj", (intermediate, 2 * intermediate))


def warn_mixed_experts(schemes: dict, expert_projection: dict) -> None:
    """vLLM's fused-MoE loader needs gate_proj, up_proj and down_proj of an experts module under one
    scheme (``CompressedTensorsMoEMethod.get_moe_method``: "All MoE projections need to have same
    quantization scheme"); warn when they differ, e.g. a static input spec without ``down_proj.input``."""
    by_module: dict = {}
    for path, (experts_path, projection) in expert_projection.items():
        by_module.setdefault(experts_path, {})[projection] = json.dumps(schemes[path], sort_keys=True)
    # a projection without qparams (written unquantized) has no scheme: mixed too (gate_proj comes with
    # up_proj, from one gate_up_proj; gate-less experts have none)
    mixed = [path for path, projections in by_module.items()
             if len(set(projections.values())) > 1 or not {"up_proj", "down_proj"} <= projections.keys()]
    if mixed:
        warn(f"export.compressed_tensors: gate_proj/up_proj and down_proj of {len(mixed)} experts module(s) "
             f"({', '.join(mixed[:4])}) have different schemes (e.g. static input scales for "
             "gate_proj/up_proj but no 'down_proj.input' site, or down_proj left unquantized); "
             "compressed-tensors and transformers load this, vLLM's fused-MoE loader requires one scheme per "
             "experts module", ExportWarning)


def warn_unloaded_experts(model: torch.nn.Module, expert_projection: Mapping, rename) -> None:
    """Warns when transformers' ``from_pretrained`` would not load the unpacked experts back into the
    model's 3-D experts: its own weight conversion for the model (``get_model_conversion_mapping``,
    renamings then converters, as ``rename_source_key`` applies them on load) maps the per-expert
    checkpoint names onto no parameter of the model (Mixtral, PhiMoE, MiniMax: it merges ``w1``/``w2``/``w3``
    names only), so it reports them MISSING and leaves them randomly initialised. ``expert_projection``:
    ``{unpacked path: (experts path, projection)}``; ``rename``: a module path's checkpoint name."""
    modules = dict(model.named_modules())
    names = [rename(path) + ".weight" for path, (experts_path, _) in expert_projection.items()
             if type(modules[experts_path]).__name__ not in _LOADED_PER_EXPERT]  # loaded into per-expert Linears
    if not names:
        return
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # no transformers (5): no conversion to ask
        return
    if not isinstance(model, PreTrainedModel):
        return
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    # the model's tensor names, a parametrized one's (inside `qstats.fake_quantized`) as its own
    loadable = dict.fromkeys((name.replace("parametrizations.", "").removesuffix(".original")
                              if ".parametrizations." in f".{name}" else name for name in model.state_dict()), True)
    missing = [name for name in names
               if rename_source_key(name, renamings, converters, model.base_model_prefix, loadable)[0] not in loadable]
    if missing:
        warn(f"export.compressed_tensors: transformers does not load {len(missing)} of the {len(names)} "
             f"unpacked expert projections of this {type(model).__name__} back (e.g. {missing[0]}): its "
             f"weight conversion for model_type {model.config.model_type!r} merges no such per-expert name "
             "into the 3-D experts, so from_pretrained reports them MISSING and leaves those experts randomly "
             "initialised; load the checkpoint with vLLM or compressed-tensors (docs/export.md)", UnloadedExpertsWarning)


def unpack_loaded_per_expert(model: torch.nn.Module, state: Mapping, tensors: dict, dropped: set) -> None:
    """Into ``tensors``: the unquantized stacked weights in ``state`` of experts that transformers
    loads per expert (Llama 4's ``gate_up_proj [E, in, 2I]`` and ``down_proj [E, I, in]``) as each
    expert's ``gate_proj``/``up_proj``/``down_proj`` Linear weight, as llm-compressor writes them
    (stacked, they loaded as freshly initialised experts); their stacked names go into ``dropped``."""
    for path, module in model.named_modules():
        names = (f"{path}.gate_up_proj", f"{path}.down_proj")
        if type(module).__name__ not in _LOADED_PER_EXPERT or not all(name in state for name in names):
            continue
        if any(name in tensors or name in dropped for name in names):  # quantized: written per expert already
            continue
        gate_up, down = (stack_layout(module, name.rpartition(".")[2]).canonical(state[name].detach())
                         for name in names)
        gate, up = gate_up.chunk(2, dim=1)  # [E, 2I, H]: gate rows, then up rows
        for expert in range(down.shape[0]):
            for name, weight in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                tensors[f"{path}.{expert}.{name}.weight"] = weight[expert].contiguous()
        dropped.update(names)
