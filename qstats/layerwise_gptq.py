"""GPTQ of a whole model, one decoder layer at a time, as llm-compressor's sequential pipeline.

`gptq_layerwise` runs `calibrate_layerwise`'s loop over a model built on the meta device. In each
layer it observes the recipe's sites and, beside them, the `qstats.hessian` of the input of every
weight the recipe quantizes (a Linear's ``weight``, a stacked-experts parameter; integer, FP8,
MX or NVFP4); replaces each such weight by `qstats.gptq` of it under the qparams of the recipe's
weight state, each Hessian summed as llm-compressor's ``accumulate_hessian`` sums it (bit for bit)
and divided by its sample count (one per sequence) rather than by its rows, so that dead input
columns dampen as there; then computes the layer's outputs with the
GPTQ'd weights (activations in float, as llm-compressor 0.14's pipeline runs with quantization
disabled) for the next one. A layer's Hessians are released with it. The weights outside the
layers (a quantized ``lm_head``) get the same step last, their Hessians observed on the last
layer's outputs with its float weights, as in llm-compressor's last subgraph; those the forward
calls before the first layer (OPT's ``project_in``) get it first, and the first layer's inputs are
computed again from them, as in its first subgraph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from .calibration import qparams_unwarned
from .export.checkpoint import check_new_folder, embedding_modules, write_index, write_tensors
from .experts import UncalibratedWarning, linearized_layout_problem
from .gptq_quantize import check_options, computes_off_dtype, gptq_unwarned
from . import distributed
from .layerwise import _select, agreed, group_up, run_layerwise
from ._qparams import QParams
from .observers._base import Observer, row_mask
from .observers.hessian import HessianState, hessian
from .recipe import Plan, Recipe, Rule
from ._warn import warn

__all__ = ["gptq_layerwise", "LayerwiseGPTQ"]


class LayerwiseGPTQ(NamedTuple):
    """What `gptq_layerwise` returns.

    Attributes:
      states: ``{module_path: {site: state}}`` of the recipe, as `calibrate_layerwise` returns
        them; `compute_qparams_tree` of them gives the qparams GPTQ used.
      weights: ``{"<module_path>.<parameter>": GPTQ'd weight}`` in the checkpoint's dtype, or the
        folder holding them (``weights_dir``); `export.compressed_tensors_layerwise` takes either
        as its ``weights``, ``model.load_state_dict(weights, strict=False)`` the dict (with
        ``assign=True`` into a model whose ``lm_head`` is tied to the embeddings: a copy into the
        shared tensor would overwrite the embeddings).
    """

    states: dict
    weights: Union[dict, str]


def _targets(plan: Plan) -> dict:
    """``{(module path, parameter site): Hessian site}`` of every weight GPTQ quantizes (a Linear's
    ``weight``: its ``input``; a stacked-experts parameter: its ``<site>.input``); a warning names
    the quantized parameters it does not (not a Linear weight or stacked experts)."""
    found, others = {}, []
    for path, entry in plan.sites.items():
        for site, observed in entry.items():
            if observed.kind != "parameter":
                continue
            problem = linearized_layout_problem(plan.modules[path]) if observed.num_experts else None
            if problem:  # GPTQ takes [E, out, in] (`Site.canonical`), which this layout does not give
                raise ValueError(f"gptq_layerwise: parameter {site!r} of the experts module {path!r} "
                                 f"({type(plan.modules[path]).__name__}): {problem}; GPTQ takes each expert's weight "
                                 "as [out, in] and would quantize it along the wrong axis")
            if observed.num_experts:
                found[(path, site)] = f"{site}.input"
            elif site == "weight" and isinstance(plan.modules[path], torch.nn.Linear):
                found[(path, site)] = "input"
            else:
                others.append(f"{path}.{site}")
    if others:
        warn(f"gptq_layerwise: {len(others)} quantized parameter(s) are not Linear weights or stacked experts "
             f"and are rounded to nearest, not GPTQ'd: {', '.join(others[:6])}", UncalibratedWarning)
    if not found:
        raise ValueError("gptq_layerwise: the recipe quantizes no Linear weight or stacked-experts parameter")
    return found


def _check_untied(plan: Plan, targets: dict) -> None:
    """Refuses a weight to GPTQ that the model ties to another name, but an output embedding tied to
    the input embeddings (an ``lm_head``): llm-compressor unties those alone, GPTQs the ``lm_head``
    and keeps the embeddings float, as here (the step replaces the loaded ``lm_head``'s weight alone,
    `export.compressed_tensors_layerwise` reads the GPTQ'd weight under its own name only). Another
    tied weight would be GPTQ'd under one name and float under the others."""
    names: dict = {}
    for name, parameter in plan.model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    embeddings = embedding_modules(plan.model)  # [input, output] of a transformers model
    for path, site in targets:
        weight = getattr(plan.modules[path], site)
        tied = names.get(id(weight), [])
        if len(tied) < 2 or (len(embeddings) == 2 and plan.modules[path] is embeddings[1]
                             and weight is getattr(embeddings[0], "weight", None)):
            continue
        others = [name for name in tied if name != f"{path}.{site}"]
        raise ValueError(
            f"gptq_layerwise: {path}.{site} is tied to {', '.join(others)}, which llm-compressor does not untie "
            f"(it unties an lm_head from the input embeddings alone); save the checkpoint untied and build the meta "
            f"model from it, or leave {path} out of the recipe (ignore it)")


def _warn_compute_dtype(plan: Plan, targets: dict) -> None:
    """Warns where a bfloat16/float16 weight's spec computes its qparams in another dtype: its
    scales are then not those its checkpoint stores (in the weight's dtype), and GPTQ's codes
    drift from llm-compressor's, which computes qparams and dequantizes in the weight's dtype."""
    off = []
    for path, site in targets:
        if computes_off_dtype(plan.site(path, site).spec, getattr(plan.modules[path], site).dtype):
            off.append(f"{path}.{site}")
    if off:
        warn(f"gptq_layerwise: {len(off)} weight(s) are bfloat16/float16 but their specs compute qparams in "
             f"another dtype ({', '.join(off[:3])}): build the recipe with observed_dtype=<the weights' dtype> "
             "(Recipe.from_scheme) for GPTQ's scales and codes to be llm-compressor's", UserWarning)


class GPTQInputsState(NamedTuple):
    """`qstats.hessian`'s fields of a weight's inputs and ``samples``: the int64 number of samples
    llm-compressor counts in them (its GPTQ Hessian is the sum divided by it, not by the rows).
    Private to `gptq_layerwise`, which releases it with its layer: not a checkpoint type."""

    approx_fields = ("total",)  # a float sum: the laws compare it to tolerance

    total: torch.Tensor
    count: torch.Tensor
    nonfinite: torch.Tensor
    samples: torch.Tensor


distributed.register_reduce_ops(GPTQInputsState, distributed.extremes_and_sums)


def _samples(x: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.Tensor:
    """llm-compressor's ``accumulate_hessian`` count of an input: its leading dimension when it has
    three or more, else one. A 2-D ``[tokens, in]`` input (an expert's) is one call whatever its mask
    keeps: llm-compressor's linearized experts call every expert once a forward on its routed tokens,
    none included, and count it (an expert routed no token at all is left to round-to-nearest by
    `_per_sample`). Of a 3-D or wider input, only the samples with a row the mask (padding) keeps."""
    if x.ndim < 3:
        return torch.ones((), dtype=torch.int64, device=x.device)
    keep = row_mask(x, weight, "gptq_layerwise")
    if x.numel() == 0 or keep is None:
        return torch.tensor(x.shape[0] if x.numel() else 0, dtype=torch.int64, device=x.device)
    return keep.reshape(x.shape[0], -1).any(dim=1).sum()


def _gptq_inputs(spec=None) -> Observer:
    """`qstats.hessian` of a weight's inputs, counting llm-compressor's samples beside its rows. Its
    ``total`` is llm-compressor's sum: ``accumulate_hessian`` multiplies the float32 rows by sqrt(2)
    before their product (``2 x^T x`` rounded so), and `_per_sample` doubles its count, so that
    GPTQ's Hessian is llm-compressor's bit for bit (``2 x^T x`` rounded otherwise differs by 1e-7,
    which flips a few codes in a thousand, more along the layers)."""
    base = hessian(spec)

    def init_fn(x):
        state = base.init(x)
        return GPTQInputsState(*state, torch.zeros_like(state.count))

    def update_fn(state, x, weight=None):
        scaled = math.sqrt(2) * x.to(torch.float32)  # llm-compressor's operation (a shared stack stays shared)
        updated = base.update(HessianState(*state[:3]), scaled, weight)
        return GPTQInputsState(*updated, state.samples + _samples(x, weight))

    def merge_fn(a, b):
        return GPTQInputsState(*base.merge(HessianState(*a[:3]), HessianState(*b[:3])), a.samples + b.samples)

    # not exact: a 2-D input is one sample however many rows it has (llm-compressor counts per call)
    return Observer(init_fn, update_fn, merge_fn, exact=False, name="gptq_inputs", shared_rows=True,
                    state_type=GPTQInputsState)


def _per_sample(state: GPTQInputsState) -> HessianState:
    """The Hessian state `qstats.gptq` divides by llm-compressor's sample count (the same GPTQ up to
    float rounding, except with dead input columns: docs/gptq.md); no row: still none. Its total is
    llm-compressor's ``2 x^T x``, so its count is doubled: `qstats.gptq`'s ``2 / (2 samples) * total``
    is llm-compressor's ``H / samples`` bit for bit (powers of two), with no copy of the total (a
    stack of expert Hessians is the layer's largest tensor) and nothing written in place."""
    samples = torch.where(state.count > 0, 2 * state.samples, torch.zeros_like(state.samples))
    return HessianState(state.total, samples, state.nonfinite)


def _hessian_plan(plan: Plan, targets: dict) -> Plan:
    """The plan observing the Hessian site of every target (with llm-compressor's sample counts)."""
    by_site: dict = {}
    for (path, _), site in targets.items():
        by_site.setdefault(site, []).append(path)
    rules = [Rule(tuple(paths), sites=(site,), observer=_gptq_inputs) for site, paths in by_site.items()]
    return Recipe(rules).resolve(plan.model)


class _Job(NamedTuple):
    """One weight to GPTQ: its parameter, the Hessian of its inputs, its spec and qparams, and its name."""

    weight: torch.Tensor
    hessian: HessianState
    spec: Any
    qparams: QParams
    name: str


def _parts(job: _Job, chunk: int) -> list:
    """The indices of ``job.weight`` GPTQ'd in one call: the whole weight (``...``, which also takes the
    whole of a 2-D weight's 0-d Hessian count), or stacked experts ``chunk`` at a time (GPTQ's working
    memory, a few ``[in, in]`` matrices per expert, is bounded by the chunk; each expert's result is its own)."""
    if job.weight.ndim == 2 or job.weight.shape[0] <= chunk:
        return [...]
    return [slice(start, start + chunk) for start in range(0, job.weight.shape[0], chunk)]


def _owners(costs: list, world: int) -> list:
    """The rank that computes each part: the costliest first, each to the least loaded rank (as
    llm-compressor's ``greedy_bin_packing``); every rank computes the same assignment."""
    loads, owners = [0] * world, [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):
        owners[index] = min(range(world), key=loads.__getitem__)
        loads[owners[index]] += costs[index]
    return owners


def _gptq_part(job: _Job, take, options: dict) -> torch.Tensor:
    """GPTQ of ``job.weight[take]``; its warnings and errors name the weight, and a chunk's experts by
    their number in the whole stack."""
    qparams = QParams(*(None if field is None else field[take] for field in job.qparams))
    hessian = HessianState(*(field[take] for field in job.hessian))
    return gptq_unwarned(job.weight[take], hessian, job.spec, qparams=qparams, name=job.name,
                         first_expert=0 if take is ... else take.start, **options)[0]


def _sharing() -> tuple:
    """``(rank, world)`` of the default process group, ``(0, 1)`` without one."""
    if group_up():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _writes() -> bool:
    """Whether this process writes shared files: rank 0, or the only process."""
    return _sharing()[0] == 0


def _gptq_jobs(jobs: list, chunk: int, options: dict, share: bool, finished: Callable) -> None:
    """GPTQ of every job; ``finished(index, weight)`` receives each job's weight once it is whole.
    With ``share`` (a process group), the parts are divided among the ranks by their cost
    (``out * in^2 + in^3`` per expert) and each rank receives the others' parts by broadcast:
    every rank holds the same weights, each computed once. Each entry of ``jobs`` is set to None
    after its last part, so that its Hessian and float weight can go before the next job's GPTQ."""
    parts = [(index, take) for index, job in enumerate(jobs) for take in _parts(job, chunk)]
    rank, world = _sharing() if share else (0, 1)
    owners = _owners([_cost(jobs[index].weight[take]) for index, take in parts], world)
    results: list = [None] * len(jobs)

    def mine() -> None:  # every allocation and GPTQ of this rank: a failure here is agreed on
        for number, ((index, take), owner) in enumerate(zip(parts, owners)):
            if results[index] is None:
                results[index] = torch.empty_like(jobs[index].weight, memory_format=torch.contiguous_format)
            if owner == rank:
                results[index][take] = _gptq_part(jobs[index], take, options)
            if number + 1 == len(parts) or parts[number + 1][0] != index:  # the job's last part
                jobs[index] = None
                if world == 1:
                    finished(index, results[index])

    agreed(world > 1, mine)
    if world > 1:
        device = distributed._probe_device(None)
        for (index, take), owner in zip(parts, owners):
            part = results[index][take]
            bits = part.view(torch.uint8).to(device)  # the bytes: any dtype, any backend
            torch.distributed.broadcast(bits, src=owner)
            if bits.device != part.device:
                part.view(torch.uint8).copy_(bits)
        for index, result in enumerate(results):
            finished(index, result)


def _cost(weight: torch.Tensor) -> int:
    """GPTQ's work on ``weight`` (``[out, in]`` or ``[E, out, in]``): ``out * in^2 + in^3`` per matrix."""
    out, columns = weight.shape[-2], weight.shape[-1]
    return (weight.numel() // (out * columns or 1)) * (out * columns * columns + columns**3)


def _layer_jobs(plan: Plan, targets: dict, states: dict, hessians: dict) -> tuple:
    """``({(path, site): _Job}, [names of the weights that have no Hessian])`` of one layer. Only
    the weights' qparams are computed: an activation state of an expert that received no token
    (uncalibrated under ``on_uncalibrated="raise"``) is the caller's to resolve, as after
    `calibrate_layerwise`, and does not stop GPTQ."""
    qparams = qparams_unwarned(_select(states, lambda path, site: (path, site) in targets), plan)
    jobs, missing = {}, []
    for (path, site), hessian_site in targets.items():
        if path not in states:
            continue
        if hessian_site not in hessians.get(path, {}):  # never called: llm-compressor rounds it to nearest too
            missing.append(f"{path}.{site}")
            continue
        # the weight as the site observes it: stacks as [E, out, in] (`Site.canonical`)
        jobs[(path, site)] = _Job(plan.parameter(path, site), _per_sample(hessians[path].pop(hessian_site)),
                                  plan.site(path, site).spec, qparams[path][site], f"{path}.{site}")
    return jobs, missing


@dataclasses.dataclass
class _GPTQRun:
    """What the layer steps of one `gptq_layerwise` call share: its arguments, the weights to GPTQ
    (``targets``: ``{(path, site): Hessian site}``), the GPTQ'd ``weights`` (``{name: weight}``, or
    ``{name: shard}`` with ``weights_dir``) and the weights never called (rounded to nearest)."""

    checkpoint: Union[str, os.PathLike]
    options: dict  # qstats.gptq's block_size, dampening, actorder
    experts_at_once: int
    weights_dir: Any  # a path, os.fspath'd by layer_step (in the checks every rank agrees on)
    share: bool  # all_reduce: the ranks divide each layer's GPTQ
    plan: Optional[Plan] = None
    targets: dict = dataclasses.field(default_factory=dict)
    weights: dict = dataclasses.field(default_factory=dict)
    uncalled: list = dataclasses.field(default_factory=list)
    ties_checked: bool = False  # `_check_untied`, at the first step: after the layers' own checks

    def layer_step(self, plan: Plan) -> tuple:
        """`run_layerwise`'s ``layer_step``, run in its checks (one rank's bad argument stops all)."""
        at_once = self.experts_at_once
        if not isinstance(at_once, int) or isinstance(at_once, bool) or at_once < 1:
            raise ValueError(f"gptq_layerwise: experts_at_once must be a positive int, got {at_once!r}")
        check_options(**self.options, where="gptq_layerwise")
        if self.weights_dir is not None:
            if not isinstance(self.weights_dir, (str, bytes, os.PathLike)):  # here, where every rank learns of it
                raise TypeError(f"gptq_layerwise: weights_dir must be a path, got {self.weights_dir!r}")
            self.weights_dir = os.fspath(self.weights_dir)
            check_new_folder(self.weights_dir, self.checkpoint, "gptq_layerwise", "weights_dir")
        self.plan, self.targets = plan, _targets(plan)
        _warn_compute_dtype(plan, self.targets)
        return _hessian_plan(plan, self.targets), self.step

    def same_on_ranks(self) -> dict:
        """The options every rank must pass alike (another split of the experts runs other broadcasts;
        a ``weights_dir`` on some ranks only, the collective after rank 0 writes the index), read
        after `layer_step` checked them."""
        actorder = "static" if self.options["actorder"] == "weight" else self.options["actorder"]  # synonyms
        return {"experts_at_once": self.experts_at_once, **self.options, "dampening": float(self.options["dampening"]),
                "actorder": actorder, "weights_dir": self.weights_dir}

    def step(self, layer_path: str, layer: torch.nn.Module, states: dict, hessians: dict) -> tuple:
        """GPTQ of the layer's targets, each weight replaced by its GPTQ'd value in the loaded layer
        (which `calibrate_layerwise` then runs) and kept in ``weights`` (with ``weights_dir``:
        written there, one shard per layer, and ``weights`` maps it to its shard). Runs on the
        modules outside the layers too, last (``layer_path`` then names them)."""
        if not self.ties_checked:
            self.ties_checked = True
            _check_untied(self.plan, self.targets)
        # rank-local work, then collectives: every rank learns whether one raised before the broadcasts
        jobs, missing = agreed(self.share, lambda: _layer_jobs(self.plan, self.targets, states, hessians))
        # the modules before the layers were GPTQ'd first (`layerwise._step_before_layers`): not again, last
        jobs = {key: job for key, job in jobs.items() if f"{key[0]}.{key[1]}" not in self.weights}
        keys, jobs = list(jobs), list(jobs.values())  # the list alone holds the Hessians (and the layer the weights)
        layer_weights = {}

        def finished(index: int, quantized: torch.Tensor) -> None:
            path, site = keys[index]
            found = self.plan.site(path, site)
            if found.layout is not None:  # back to the stored layout, which the model and checkpoint hold
                quantized = found.stored(quantized).contiguous()
            self.plan.modules[path]._parameters[site] = torch.nn.Parameter(quantized, requires_grad=False)
            layer_weights[f"{path}.{site}"] = quantized.cpu()  # kept or written from the CPU, whatever the device

        _gptq_jobs(jobs, self.experts_at_once, self.options, self.share, finished)
        self.uncalled.extend(missing)  # warned of once, by `finish`
        if self.weights_dir is None:
            self.weights.update(layer_weights)
        elif layer_weights:
            filename = f"gptq-{len(set(self.weights.values())) + 1:05d}.safetensors"
            if _writes():
                write_tensors(self.weights_dir, layer_weights, filename)
            self.weights.update(dict.fromkeys(layer_weights, filename))
        return states, set(keys)  # the layer then runs with its GPTQ'd weights, activations in float

    def remove_written(self) -> None:
        """Removes the weight files a failed run wrote (by the writing rank): while they remain, a
        rerun into ``weights_dir`` is refused."""
        if self.weights_dir is not None and _writes():
            for filename in set(self.weights.values()):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(self.weights_dir, filename))

    def finish(self, states: dict) -> LayerwiseGPTQ:
        """The result, once every layer and the modules outside them are done; warns once naming the
        weights of every layer that were never called (as `qstats.calibrate` names the sites that saw no data)."""
        if self.uncalled:
            more = f" and {len(self.uncalled) - 6} more" if len(self.uncalled) > 6 else ""
            warn(f"gptq_layerwise: {len(self.uncalled)} weight(s) were never called, so have no Hessian, and are "
                 f"rounded to nearest: {', '.join(self.uncalled[:6])}{more}", UncalibratedWarning)
        if self.weights_dir is None:
            return LayerwiseGPTQ(states, self.weights)
        # every rank returns once rank 0 has written the index, and raises if that failed
        agreed(self.share, lambda: write_index(self.weights_dir, self.weights) if _writes() else None)
        return LayerwiseGPTQ(states, self.weights_dir)


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
    device: Optional[Union[str, torch.device]] = None,
) -> LayerwiseGPTQ:
    """GPTQ of every Linear and experts weight of ``recipe``, one decoder layer at a time (llm-compressor's
    ``oneshot`` with a ``GPTQModifier`` and the sequential pipeline).

    Each layer is loaded, calibrated (the recipe's states and the Hessians of the quantized
    weights' inputs), GPTQ'd (`qstats.gptq` with the qparams of the recipe's weight states),
    run with its GPTQ'd weights and float activations over every batch to give the next layer's
    inputs (llm-compressor 0.14 runs its pipeline with quantization disabled), and released. The
    weights outside the decoder layers (a quantized ``lm_head``) are GPTQ'd last, on the last
    layer's outputs with its float weights, as in llm-compressor's last subgraph (which holds the
    last layer and the modules after it); those called before the first layer (OPT's
    ``project_in``) first, before the first layer's inputs are computed from them.

    Args:
      model, checkpoint, batches, recipe, offload_dir, layers, progress, observation_weight,
        all_experts, all_reduce, device: as in `calibrate_layerwise` (on ``device``, GPTQ runs there
        too; the weights returned or written are on the CPU). With ``all_reduce`` the Hessians are
        merged across ranks with the activation states, and each layer's GPTQ is divided among
        the ranks (weights, or expert chunks, by cost) and broadcast: each weight is GPTQ'd once
        and every rank holds the same weights. Every rank passes the same arguments but
        ``batches`` (ranks passing another ``weights_dir``, or one only on some ranks, raise a
        ValueError on every rank); rank 0 writes ``weights_dir``.
      block_size, dampening, actorder: as in `qstats.gptq`; ``actorder`` defaults to ``"static"``,
        as ``GPTQModifier``'s.
      weights_dir: write the GPTQ'd weights there (safetensors, one file per layer, and
        ``model.safetensors.index.json``) as each layer is done, instead of keeping them in memory.
      experts_at_once: stacked experts GPTQ'd together (GPTQ's working memory is a few ``[in, in]``
        float32 matrices per expert); each expert's result does not depend on it.

    Returns:
      `LayerwiseGPTQ` ``(states, weights)``.

    Raises:
      ValueError: as `calibrate_layerwise`; a recipe without Linear or expert weights; a weight to
        GPTQ that the model ties to another than the input embeddings (an ``lm_head`` tied to them is
        GPTQ'd alone, as llm-compressor unties it, the embeddings staying float).
    """
    options = {"block_size": block_size, "dampening": dampening, "actorder": actorder}
    run = _GPTQRun(checkpoint, options, experts_at_once, weights_dir, all_reduce)
    try:
        states = run_layerwise(
            model, checkpoint, batches, recipe, states=None, propagate="float", offload_dir=offload_dir,
            layers=layers, progress=progress, observation_weight=observation_weight, all_experts=all_experts,
            all_reduce=all_reduce, device=device, layer_step=run.layer_step, where="gptq_layerwise",
            same_on_ranks=run.same_on_ranks,
        )  # fmt: skip
    except BaseException:
        run.remove_written()
        raise
    return run.finish(states)
