"""Stacked experts (3-D ``gate_up_proj [E, 2I, H]`` or gate-less ``up_proj [E, I, H]``, ``down_proj
[E, H, I]``) unpacked into per-expert Linear entries ``<path>.<e>.gate_proj`` / ``up_proj`` /
``down_proj``, as llm-compressor's ``LinearExperts2D`` unpacks them (``gate_up_proj[e, :I]`` is gate);
transposed, interleaved or biased stacks are refused. So that vLLM's fused-MoE loader
and transformers read them. See docs/export.md.
"""

from __future__ import annotations

import json
from typing import Mapping, NamedTuple, Optional

import torch

from .._granularity import PerBlock, PerTensor, TensorGroup
from .._qparams import QParams
from .._spec import QuantSpec
from .config import fail, quantization_args
from .linear import Entry
from .scales import check_qparams, scale_dtype
from .._warn import warn

__all__ = ["EXPERT_SITES", "expert_entries", "warn_mixed_experts"]

EXPERT_SITES = ("gate_up_proj", "up_proj", "down_proj", "input", "gate_up_proj.input", "up_proj.input",
                "down_proj.input")
_INPUT_SITES = ("input", "gate_up_proj.input", "up_proj.input", "down_proj.input")


def _slice_qparams(qp: Optional[QParams], index) -> Optional[QParams]:
    if qp is None:
        return None
    return QParams(*(None if field is None else field[index] for field in qp))


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
        if field.dim() < 1 or field.shape[0] != covered.shape[0]:
            return field
        keep = covered.reshape(-1, *([1] * (field.dim() - 1)))
        return torch.where(keep, field, field[donor : donor + 1])

    minval = None if qp.minval is None else fill(qp.minval)  # follows the scale and zero point it goes with
    return qp._replace(scale=fill(qp.scale), zero_point=fill(qp.zero_point), global_scale=fill(qp.global_scale),
                       minval=minval)


def _row_slice(qp: QParams, spec: QuantSpec, start: int, stop: int, where: str) -> QParams:
    """The qparams of rows ``start:stop`` of a weight whose qparams are ``qp`` (one expert)."""
    granularity = spec.granularity
    if isinstance(granularity, PerTensor):
        return qp
    if isinstance(granularity, PerBlock):
        rows = granularity.block_shape[0]
        if start % rows or stop % rows:
            fail(where, f"rows {start}:{stop} of the fused weight do not fall on {granularity!r} block boundaries")
        start, stop = start // rows, stop // rows
    return QParams(*(field[start:stop] if field is not None and field.dim() >= 1 else field for field in qp))


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
    """ValueError naming ``path`` for experts whose per-expert Linears are not row slices of their
    stacks: transposed (``[E, in, out]``, gpt-oss), gate and up interleaved column by column
    (``is_concatenated=False``, gpt-oss), or with parameters beyond the stacked weights (biases)."""
    problems = []
    if getattr(module, "is_transposed", False):
        problems.append("its stacked weights are transposed ([E, in, out]; qstats observes rows of [E, out, in])")
    if getattr(module, "is_concatenated", True) is False:
        problems.append("its gate and up projections are interleaved column by column in gate_up_proj")
    others = sorted(name for name in params if name not in (first, "down_proj"))
    if others:  # they would be dropped with the fused parameters
        problems.append(f"it has other parameters ({', '.join(others)}), e.g. biases, that no exported tensor holds")
    if problems:
        fail(path, "stacked experts are not exportable yet: " + "; ".join(problems))


def _stacked_parameters(path: str, module: torch.nn.Module, sites: Mapping, num_experts: int) -> tuple:
    """``(first, up, down)``: the name of the first projection (``gate_up_proj [E, 2I, H]``, gate rows
    first, or gate-less ``up_proj [E, I, H]``) and the stacks of an exportable experts module, after
    checking its layout, its sites and the leading expert dimension of their qparams."""
    params = dict(module.named_parameters(recurse=False))
    first = "gate_up_proj" if "gate_up_proj" in params else "up_proj"
    up, down = params.get(first), params.get("down_proj")
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
        fail(path, f"{first} {tuple(up.shape)} and down_proj {tuple(down.shape)} are not the layout "
             f"[E, {'2I' if first == 'gate_up_proj' else 'I'}, H] / [E, H, I]")
    for site, qp in sites.items():
        if qp is not None:
            qp = check_qparams(qp, f"{path}/{site}")
            if qp.scale.dim() < 1 or qp.scale.shape[0] != num_experts:
                fail(f"{path}/{site}", f"stacked qparams need a leading expert dimension {num_experts}, "
                     f"got scale of shape {tuple(qp.scale.shape)}")
    return first, up.detach(), down.detach()


class _Experts(NamedTuple):
    """What each expert's projections are cut from: the module's stacked weights (``first``:
    ``gate_up_proj`` or gate-less ``up_proj``), its sites ``{site: stacked QParams}`` and specs, and
    its input site."""

    path: str
    up: torch.Tensor
    down: torch.Tensor
    sites: Mapping
    specs: Mapping
    input_name: str
    input_dynamic: bool
    dynamic: frozenset
    first: str


def expert_entries(
    path: str,
    module: torch.nn.Module,
    sites: Mapping,
    specs: Mapping,
    num_experts: int,
    tensors: dict,
    dynamic=frozenset(),
) -> list:
    """Per-expert Linear entries of a stacked experts module; a projection without qparams is written
    unquantized into ``tensors``. ``dynamic``: activation sites whose scales come at run time.
    """
    first, up, down = _stacked_parameters(path, module, sites, num_experts)
    dtype = scale_dtype(module, up)
    # the routed hidden states: "<first>.input" equals "input"
    input_name = f"{first}.input" if f"{first}.input" in sites else "input"
    input_spec = specs.get(input_name)
    input_dynamic = (
        input_spec is not None and quantization_args(input_spec, "input", path, input_name in dynamic)["dynamic"] is True
    )
    sites = {site: fill_uncovered_experts(qp, specs.get(site)) if site in _INPUT_SITES else qp
             for site, qp in sites.items()}
    experts = _Experts(path, up, down, sites, specs, input_name, input_dynamic, frozenset(dynamic), first)
    entries = []
    for expert in range(num_experts):
        for name, weight, entry_sites in _expert_projections(experts, expert, tensors):
            entries.append(Entry(f"{path}.{expert}.{name}", weight, dtype, entry_sites, experts=(path, name)))
    return entries


def _up_rows(experts: _Experts) -> tuple:
    """``(name, (start, stop))`` of the Linears cut from each expert's first stack: gate rows then
    up rows of ``gate_up_proj``, or all of a gate-less ``up_proj``."""
    intermediate = experts.down.shape[2]
    if experts.first == "up_proj":
        return (("up_proj", (0, intermediate)),)
    return ("gate_proj", (0, intermediate)), ("up_proj", (intermediate, 2 * intermediate))


def _expert_projections(experts: _Experts, expert: int, tensors: dict) -> list:
    """``(name, weight, {site: (QParams, spec, where)})`` of one expert's quantized projections;
    its unquantized ones go to ``tensors``."""
    path, up, down, sites, specs, input_name = experts[:6]
    prefix, first = f"{path}.{expert}", experts.first
    input_spec = specs.get(input_name)
    input_dynamic = input_name in experts.dynamic
    inputs = {}
    if input_name in sites:
        where = f"{path}/{input_name}[{expert}]"
        inputs["input"] = (_slice_qparams(sites[input_name], expert), input_spec, where, input_dynamic)
    projections = []
    if first in sites:
        qp, spec = _slice_qparams(sites[first], expert), specs.get(first)
        for name, rows in _up_rows(experts):
            where = f"{path}/{first}[{expert}] ({name})"
            part, part_spec = qp, spec
            if spec is not None and first == "gate_up_proj":
                part = _row_slice(qp, spec, *rows, where)
                part, part_spec = _whole_block(part, spec, (rows[1] - rows[0], up.shape[2]))
            weight_site = (part, part_spec, where, False)
            projections.append((name, up[expert, rows[0] : rows[1]], {"weight": weight_site, **inputs}))
    elif inputs:
        fail(f"{path}/{input_name}", f"input scales of stacked experts need the {first} weights exported too")
    else:  # unquantized: the float weights, unpacked like the quantized ones
        for name, rows in _up_rows(experts):
            tensors[f"{prefix}.{name}.weight"] = up[expert, rows[0] : rows[1]]
    if "down_proj.input" in sites and "down_proj" not in sites:
        fail(f"{path}/down_proj.input", "input scales of down_proj need the down_proj weights exported too")
    if "down_proj" not in sites:
        tensors[f"{prefix}.down_proj.weight"] = down[expert]
        return projections
    where = f"{path}/down_proj[{expert}]"
    down_sites = {"weight": (_slice_qparams(sites["down_proj"], expert), specs.get("down_proj"), where, False)}
    if "down_proj.input" in sites:  # the intermediate activation act(gate) * up
        qp = _slice_qparams(sites["down_proj.input"], expert)
        where = f"{path}/down_proj.input[{expert}]"
        down_sites["input"] = (qp, specs.get("down_proj.input"), where, "down_proj.input" in experts.dynamic)
    elif experts.input_dynamic:  # run-time scales: the same dynamic activation quantization as gate/up
        down_sites["input"] = (None, input_spec, f"{path}/{input_name} (down_proj)", input_dynamic)
    projections.append(("down_proj", down[expert], down_sites))
    return projections


def warn_mixed_experts(schemes: dict, expert_projection: dict) -> None:
    """vLLM's fused-MoE loader needs gate_proj, up_proj and down_proj of an experts module under one
    scheme (``CompressedTensorsMoEMethod.get_moe_method``: "All MoE projections need to have same
    quantization scheme"); warn when they differ, e.g. a static input spec without ``down_proj.input``."""
    by_module: dict = {}
    for path, (experts_path, projection) in expert_projection.items():
        by_module.setdefault(experts_path, {})[projection] = json.dumps(schemes[path], sort_keys=True)
    # a projection without qparams (written unquantized) has no scheme: mixed too (gate_proj comes with
    # up_proj, from one gate_up_proj; gate-less experts have none)
    mixed = [
        path for path, projections in by_module.items()
        if len(set(projections.values())) > 1 or not {"up_proj", "down_proj"} <= projections.keys()
    ]
    if mixed:
        warn(
            f"export.compressed_tensors: gate_proj/up_proj and down_proj of {len(mixed)} experts module(s) "
            f"({', '.join(mixed[:4])}) have different schemes (e.g. static input scales for gate_proj/up_proj "
            "but no 'down_proj.input' site, or down_proj left unquantized); compressed-tensors and "
            "transformers load this, vLLM's fused-MoE "
            "loader requires one scheme per experts module",
        )
