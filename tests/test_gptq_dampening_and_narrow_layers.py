"""qstats.gptq against llm-compressor 0.14 on angles tests/test_gptq*.py do not cover: the dampening's
mean diagonal bit for bit (its per-module path), tiny layers (fewer columns than a block), tied
Hessian diagonals under activation ordering, large dampening, asymmetric integer blocks; and the
original GPTQ's running group scales against an independent loop on compressed-tensors' rounding."""

from __future__ import annotations

from copy import copy

import pytest
import torch

import qstats
from qstats.gptq_quantize import _inverse_hessian_factor, gptq
from qstats.observers.hessian import gptq_hessian, hessian

llmc_gptq = pytest.importorskip("llmcompressor.modifiers.gptq.gptq_quantize")
llmc_helpers = pytest.importorskip("llmcompressor.modifiers.gptq.helpers")
llmc_observers = pytest.importorskip("llmcompressor.observers")
from compressed_tensors.quantization import QuantizationArgs, fake_quantize  # noqa: E402


def _data(out, columns, rows, seed, dead=(), x=None):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, columns, generator=gen) * 0.05
    if x is None:
        x = torch.randn(rows, columns, generator=gen) * torch.linspace(0.05, 2.0, columns)
    x = x.clone()
    x[:, list(dead)] = 0.0
    return weight, hessian().update(hessian().init(x), x)


def _llmc_qparams(args, weight):
    obs = llmc_observers.Observer.load_from_registry("memoryless_minmax", base_name="weight",
                                                     args=args.model_copy(deep=True))
    obs(weight)
    return obs.get_qparams()


def _same_codes(args, weight, state, block_size=128, dampening=0.01):
    """Fraction of qstats' codes equal to llm-compressor's quantize_weight (batch of one, its own qparams)."""
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    found = _llmc_qparams(args, weight)
    obs = qstats.minmax(spec)
    layout = qstats.compute_qparams(obs.update(obs.init(weight), weight), spec)
    qparams = layout._replace(scale=found["scale"].reshape(layout.scale.shape),
                              zero_point=found["zero_point"].reshape(layout.zero_point.shape).to(layout.zero_point.dtype))
    want, _, fallback = llmc_gptq.quantize_weight(weight.clone()[None], gptq_hessian(state)[None], found["scale"][None],
                                                  found["zero_point"][None], None, args, blocksize=block_size,
                                                  percdamp=dampening)
    got, codes, _ = gptq(weight, state, spec, block_size=block_size, dampening=dampening,
                         actorder=args.actorder and "static", qparams=qparams)
    assert not fallback[0]
    return (codes == qstats.quantize(want[0], qparams, spec)).float().mean().item(), (got - want[0]).abs().max().item()


@pytest.mark.parametrize("dampening", [0.01, 100.0])
def test_the_dampened_factor_is_llm_compressors_bit_for_bit(dampening):
    """llm-compressor (fewer than 16 modules at once, its default on CPU) dampens with
    torch.mean(torch.diag(H)), a contiguous copy; the mean over the strided diagonal differs in
    its last bit for this Hessian, and so did the factor."""
    weight, state = _data(64, 256, 600, seed=5)
    normalized = gptq_hessian(state)
    strided = torch.mean(torch.diagonal(normalized), dim=-1)
    assert strided != torch.mean(torch.diag(normalized))  # the case the old code got wrong
    reference = llmc_helpers.factorize_hessian(weight.clone()[None], normalized.clone()[None], dampening,
                                               torch.zeros(1, dtype=torch.bool))[0]
    ours, _ = _inverse_hessian_factor(normalized.clone(), dampening, torch.tensor(True))
    assert torch.equal(ours, reference)
    # stacked (one batched mean over experts) and vmapped: each expert's factor the same bits
    stacked, _ = _inverse_hessian_factor(normalized.expand(3, -1, -1).clone(), dampening, torch.ones(3, dtype=torch.bool))
    assert torch.equal(stacked, reference.expand(3, -1, -1))


def test_rank_deficient_int8_codes_equal_llm_compressor(single_thread_quiet):
    """40 rows, 256 columns: the dampening defines the smallest eigenvalues; one bit of its mean
    moved 0.04% of the int8 codes (14 of 32768) before (one thread: the sums' order is fixed)."""
    weight, state = _data(128, 256, 40, seed=9)
    args = QuantizationArgs(num_bits=8, symmetric=True, strategy="channel", actorder="static")
    same, difference = _same_codes(args, weight, state)
    assert same == 1.0 and difference == 0.0


@pytest.mark.parametrize("columns,strategy,group", [(1, "channel", None), (5, "channel", None), (3, "tensor", None),
                                                    (12, "group", 4), (24, "group", 8)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_layers_narrower_than_a_block_equal_llm_compressor(columns, strategy, group, symmetric):
    weight, state = _data(7, columns, 30, seed=columns)
    for bits in (4, 8):
        for actorder in (None, "static"):
            args = QuantizationArgs(num_bits=bits, symmetric=symmetric, strategy=strategy, group_size=group,
                                    actorder=actorder)
            assert _same_codes(args, weight, state) == (1.0, 0.0)


def test_tied_diagonals_and_large_dampening_equal_llm_compressor():
    """Inputs of -1 and 1 (every diagonal equal: activation order is argsort's order of ties), and
    dampening far above the Hessian (GPTQ near round-to-nearest), with dead columns."""
    x = torch.ones(50, 64)
    x[:25] = -1
    weight, state = _data(32, 64, 50, seed=2, x=x)
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=16, actorder="static")
    assert _same_codes(args, weight, state, block_size=16) == (1.0, 0.0)
    weight, state = _data(32, 64, 100, seed=1, dead=(3, 10, 11))
    for dampening in (10.0, 1e6):
        args = QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=16, actorder="static")
        assert _same_codes(args, weight, state, dampening=dampening) == (1.0, 0.0)


@pytest.mark.parametrize("block", [[16, 32], [5, 24]])
def test_asymmetric_int8_blocks_equal_llm_compressor(block):
    weight, state = _data(40, 64, 100, seed=4)
    for actorder in (None, "static"):
        args = QuantizationArgs(num_bits=8, symmetric=False, strategy="block", block_structure=block, actorder=actorder)
        assert _same_codes(args, weight, state, block_size=32) == (1.0, 0.0)


def _original_gptq(weight, normalized, args, block_size, dampening=0.01):
    """The original GPTQ loop (arXiv:2210.17323, groups' min/max from the weight at each block's
    start), on llm-compressor's observer and compressed-tensors' fake_quantize."""
    work, h, columns, size = weight.clone(), normalized.clone(), weight.shape[1], args.group_size
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    work[:, dead] = 0
    h += dampening * torch.mean(torch.diag(h)) * torch.eye(columns)
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    channel = copy(args)
    channel.strategy = "channel"
    per_row = QuantizationArgs(num_bits=args.num_bits, symmetric=args.symmetric, strategy="channel")
    quantized = torch.zeros_like(work)
    for start in range(0, columns, block_size):
        stop = min(start + block_size, columns)
        block, errors = work[:, start:stop].clone(), torch.zeros(work.shape[0], stop - start)
        for i in range(stop - start):
            if (start + i) % size == 0:
                found = _llmc_qparams(per_row, work[:, start + i: start + i + size])
            column = block[:, i]
            q = fake_quantize(column[:, None], found["scale"], found["zero_point"], channel)[:, 0]
            errors[:, i] = (column - q) / inverse[start + i, start + i]
            quantized[:, start + i] = q
            block[:, i:] -= errors[:, i, None] * inverse[start + i, start + i: stop][None, :]
        work[:, stop:] -= errors @ inverse[start:stop, stop:]
    return quantized


@pytest.mark.parametrize("group,block_size", [(16, 32), (48, 32), (96, 16)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_running_group_scales_equal_the_original_gptq_loop(group, block_size, symmetric):
    """Groups smaller than, straddling and wider than a block; dead columns zeroed before the
    groups' min/max, as the original."""
    weight, state = _data(24, 96, 150, seed=group + block_size, dead=(2, 50))
    args = QuantizationArgs(num_bits=4, symmetric=symmetric, strategy="group", group_size=group)
    got, _, _ = gptq(weight, state, qstats.QuantSpec.from_compressed_tensors(args), block_size=block_size)
    assert torch.equal(got, _original_gptq(weight, gptq_hessian(state), args, block_size))
