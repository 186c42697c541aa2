"""GPTQ of a whole model, one decoder layer at a time, as llm-compressor's sequential pipeline.

`gptq_layerwise` runs `calibrate_layerwise`'s loop over a model built on the meta device. In each
layer it observes the recipe's sites and, beside them, the `qstats.hessian` of the input of every
weight the recipe quantizes to integers (a Linear's ``weight``, a stacked-experts parameter);
replaces each such weight by `qstats.gptq` of it under the qparams of the recipe's weight state;
then computes the layer's outputs through the quantized layer for the next one. A layer's Hessians
are released with it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from .calibrate import compute_qparams_tree
from .export.checkpoint import check_new_folder, write_index, write_tensors
from .experts import UncalibratedWarning
from .gptq import gptq
from .layerwise import _layerwise
from ._qparams import QParams
from .observers.hessian import HessianState, hessian
from .recipe import Plan, Recipe, Rule

__all__ = ["gptq_layerwise", "LayerwiseGPTQ"]


class LayerwiseGPTQ(NamedTuple):
    """What `gptq_layerwise` returns.

    Attributes:
      states: ``{module_path: {site: state}}`` of the recipe, as `calibrate_layerwise` returns
        them; `compute_qparams_tree` of them gives the qparams GPTQ used.
      weights: ``{"<module_path>.<parameter>": GPTQ'd weight}`` in the checkpoint's dtype, or the
        folder holding them (``weights_dir``); `export.compressed_tensors_layerwise` takes either
        as its ``weights``, ``model.load_state_dict(weights, strict=False)`` the dict.
    """

    states: dict
    weights: Union[dict, str]


def _hessian_site(plan: Plan, path: str, site: str) -> Optional[str]:
    """The site whose Hessian GPTQ of parameter ``site`` of ``path`` needs, or None when GPTQ does
    not apply (not a Linear weight or stacked-experts parameter, or a float format)."""
    entry = plan.site(path, site)
    if entry.kind != "parameter" or entry.spec.is_float:
        return None
    if entry.num_experts:
        return f"{site}.input"
    return "input" if site == "weight" and isinstance(plan.modules[path], torch.nn.Linear) else None


def _targets(plan: Plan) -> dict:
    """``{(module path, parameter site): Hessian site}`` of every weight GPTQ quantizes; a warning
    names the integer parameters it does not (not a Linear weight or stacked experts)."""
    found, others = {}, []
    for path, entry in plan.sites.items():
        for site, observed in entry.items():
            hessian_site = _hessian_site(plan, path, site)
            if hessian_site is not None:
                found[(path, site)] = hessian_site
            elif observed.kind == "parameter" and not observed.spec.is_float:
                others.append(f"{path}.{site}")
    if others:
        warnings.warn(f"gptq_layerwise: {len(others)} integer parameter(s) are not Linear weights or stacked experts "
                      f"and are rounded to nearest, not GPTQ'd: {', '.join(others[:6])}", UncalibratedWarning,
                      stacklevel=3)
    if not found:
        raise ValueError(
            "gptq_layerwise: the recipe quantizes no Linear weight or stacked-experts parameter to an integer format"
        )
    return found


def _hessian_plan(plan: Plan, targets: dict) -> Plan:
    """The plan observing the Hessian site of every target."""
    by_site: dict = {}
    for (path, _), site in targets.items():
        by_site.setdefault(site, []).append(path)
    rules = [Rule(tuple(paths), sites=(site,), observer=hessian) for site, paths in by_site.items()]
    return Recipe(rules).resolve(plan.model)


def _gptq_in_chunks(weight: torch.Tensor, state: HessianState, spec, qparams: QParams, chunk: int, options: dict):
    """`qstats.gptq` of ``weight``, stacked experts ``chunk`` at a time (each expert's result is its
    own: the working memory, a few ``[in, in]`` matrices per expert, is bounded by the chunk)."""
    if weight.ndim == 2 or weight.shape[0] <= chunk:
        return gptq(weight, state, spec, qparams=qparams, **options)[0]
    parts = []
    for start in range(0, weight.shape[0], chunk):
        take = slice(start, start + chunk)
        part_qparams = QParams(*(None if field is None else field[take] for field in qparams))
        part_state = HessianState(*(field[take] for field in state))
        parts.append(gptq(weight[take], part_state, spec, qparams=part_qparams, **options)[0])
    return torch.cat(parts)


def _writes() -> bool:
    """Whether this process writes shared files: rank 0, or the only process (ranks hold equal weights)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return not distributed or torch.distributed.get_rank() == 0


def _gptq_step(plan: Plan, targets: dict, weights: dict, options: dict, weights_dir: Optional[str],
               experts_at_once: int, uncalled: list) -> Callable:
    """The layer step: GPTQ of the layer's targets, each weight replaced by its GPTQ'd value in the
    loaded layer (which `calibrate_layerwise` then runs) and kept in ``weights`` (with
    ``weights_dir``: written there, one shard per layer, and ``weights`` maps it to its shard)."""

    def step(layer_path: str, layer: torch.nn.Module, states: dict, hessians: dict) -> tuple:
        qparams = compute_qparams_tree(states, plan)
        layer_weights, missing, done = {}, [], set()
        for (path, site), hessian_site in targets.items():
            if path not in states:
                continue
            if hessian_site not in hessians.get(path, {}):  # never called: llm-compressor rounds it to nearest too
                missing.append(f"{path}.{site}")
                continue
            module = plan.modules[path]
            hessian_state = hessians[path].pop(hessian_site)  # released once used
            quantized = _gptq_in_chunks(getattr(module, site), hessian_state, plan.site(path, site).spec,
                                        qparams[path][site], experts_at_once, options)
            module._parameters[site] = torch.nn.Parameter(quantized, requires_grad=False)
            layer_weights[f"{path}.{site}"] = quantized
            done.add((path, site))
        if missing:
            uncalled.extend(missing)
            warnings.warn(f"gptq_layerwise: {len(missing)} weight(s) of {layer_path} were never called, so have no "
                          f"Hessian, and are rounded to nearest: {', '.join(missing[:6])}", UncalibratedWarning,
                          stacklevel=2)
        if weights_dir is None:
            weights.update(layer_weights)
        elif layer_weights:
            filename = f"gptq-{len(set(weights.values())) + 1:05d}.safetensors"
            if _writes():
                write_tensors(weights_dir, layer_weights, filename)
            weights.update(dict.fromkeys(layer_weights, filename))
        return states, done  # the GPTQ'd weights are on their grid: propagation does not fake-quantize them

    return step


def gptq_layerwise(
    model: torch.nn.Module,
    checkpoint: Union[str, os.PathLike],
    batches,
    recipe: Union[Recipe, Plan],
    *,
    block_size: int = 128,
    dampening: float = 0.01,
    actorder: Optional[str] = "static",
    offload_dir: Optional[Union[str, os.PathLike]] = None,
    weights_dir: Optional[Union[str, os.PathLike]] = None,
    experts_at_once: int = 8,
    layers: Optional[str] = None,
    progress: bool = True,
    observation_weight: Optional[Callable[[Any], Optional[torch.Tensor]]] = None,
    all_experts: bool = False,
    all_reduce: bool = False,
) -> LayerwiseGPTQ:
    """GPTQ of every integer weight of ``recipe``, one decoder layer at a time (llm-compressor's
    ``oneshot`` with a ``GPTQModifier`` and the sequential pipeline).

    Each layer is loaded, calibrated (the recipe's states and the Hessians of the quantized
    weights' inputs), GPTQ'd (`qstats.gptq` with the qparams of the recipe's weight states),
    run quantized (`qstats.fake_quantized`) over every batch to give the next layer's inputs, and
    released. Weights outside the decoder layers are not GPTQ'd (llm-compressor's ``ignore``
    usually holds ``lm_head``): their states are returned as `calibrate_layerwise` returns them.

    Args:
      model, checkpoint, batches, recipe, offload_dir, layers, progress, observation_weight,
        all_experts, all_reduce: as in `calibrate_layerwise` (Hessians are merged across ranks
        with the activation states).
      block_size, dampening, actorder: as in `qstats.gptq`; ``actorder`` defaults to ``"static"``,
        as ``GPTQModifier``'s.
      weights_dir: write the GPTQ'd weights there (safetensors, one file per layer, and
        ``model.safetensors.index.json``) as each layer is done, instead of keeping them in memory.
      experts_at_once: stacked experts GPTQ'd together (GPTQ's working memory is a few ``[in, in]``
        float32 matrices per expert); each expert's result does not depend on it.

    Returns:
      `LayerwiseGPTQ` ``(states, weights)``.

    Raises:
      ValueError: as `calibrate_layerwise`; a recipe without integer Linear or expert weights.
    """
    if not isinstance(experts_at_once, int) or isinstance(experts_at_once, bool) or experts_at_once < 1:
        raise ValueError(f"gptq_layerwise: experts_at_once must be a positive int, got {experts_at_once!r}")
    weights: dict = {}
    weights_dir = None if weights_dir is None else os.fspath(weights_dir)
    if weights_dir is not None:
        check_new_folder(weights_dir, checkpoint, "gptq_layerwise", "weights_dir")
    options = {"block_size": block_size, "dampening": dampening, "actorder": actorder}

    targets: dict = {}
    uncalled: list = []

    def layer_step(plan: Plan) -> tuple:
        targets.update(_targets(plan))
        return _hessian_plan(plan, targets), _gptq_step(plan, targets, weights, options, weights_dir, experts_at_once,
                                                              uncalled)

    states = _layerwise(
        model, checkpoint, batches, recipe, states=None, propagate="quantized", offload_dir=offload_dir,
        layers=layers, progress=progress, observation_weight=observation_weight, all_experts=all_experts,
        all_reduce=all_reduce, layer_step=layer_step, where="gptq_layerwise",
    )  # fmt: skip
    done = set(weights) | set(uncalled)
    outside = [f"{path}.{site}" for path, site in targets if f"{path}.{site}" not in done and path in states]
    if outside:
        warnings.warn(f"gptq_layerwise: {len(outside)} weight(s) outside the decoder layers are rounded to nearest, "
                      f"not GPTQ'd: {', '.join(outside[:6])}", UncalibratedWarning, stacklevel=2)
    if weights_dir is None:
        return LayerwiseGPTQ(states, weights)
    if not _writes():
        return LayerwiseGPTQ(states, weights_dir)
    write_index(weights_dir, weights)
    return LayerwiseGPTQ(states, weights_dir)
