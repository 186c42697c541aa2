"""Codes as compressed-tensors' compressors store them: signed int8, int32 words of packed
integers (``pack-quantized``) and bytes of two fp4 codes (``nvfp4-pack-quantized``,
``mxfp4-pack-quantized``)."""

from __future__ import annotations

import torch

__all__ = ["pack_fp4", "pack_int32", "signed_int8"]


def signed_int8(codes: torch.Tensor, offset: int) -> torch.Tensor:
    """Integer codes (or zero points) moved by ``offset`` onto compressed-tensors' signed range,
    as int8 (`qstats.export.config.code_offset`). The callers check them, naming the site: a weight's
    codes come from `quantize` (integers of the spec's range, which ``code_offset`` fits into the args'
    range), zero points from `qstats.export.scales.zero_point` (whole numbers of the args' range)."""
    return (codes.to(torch.int16) + offset).to(torch.int8)


def pack_int32(values: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Little-endian packing of signed ``num_bits`` integers (rows of ``values``) into int32 words, as
    compressed-tensors' ``pack_to_int32``; a row takes ``ceil(cols * num_bits / 32)`` words.
    """
    rows, cols = values.shape
    unsigned = values.to(torch.int64) + (1 << (num_bits - 1))
    if 32 % num_bits:  # values straddle words
        return _pack_straddling(unsigned, num_bits)
    per_word = 32 // num_bits  # whole values per word: value i of a word at bit i * num_bits
    words_per_row = -(-cols // per_word)
    unsigned = torch.nn.functional.pad(unsigned, (0, words_per_row * per_word - cols))
    shifts = torch.arange(per_word, device=values.device) * num_bits
    # sizes spelled out: -1 is ambiguous for a tensor of no rows (a Linear without outputs)
    words = (unsigned.reshape(rows, words_per_row, per_word) << shifts).sum(-1)  # disjoint bits: the sum is an or
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_straddling(unsigned: torch.Tensor, num_bits: int) -> torch.Tensor:
    """`pack_int32` of unsigned values whose ``num_bits`` does not divide 32: value i of a row at bits
    ``[i * num_bits, (i + 1) * num_bits)`` of the row's words, its high bits in the next word where it
    crosses a boundary (two scatters over the values, as compressed-tensors packs them; a stream of
    1-bit values took 8x the memory and time)."""
    rows, cols = unsigned.shape
    start = torch.arange(cols, device=unsigned.device) * num_bits
    word, shift = start // 32, start % 32
    # a word more than the row needs: the (zero) high bits of a value ending on the last boundary
    words = unsigned.new_zeros(rows, -(-cols * num_bits // 32) + 1)
    part = (unsigned << shift).bitwise_and_(0xFFFFFFFF)  # disjoint bits: the sums are ors
    words.scatter_add_(1, word.expand(rows, cols), part)
    words.scatter_add_(1, (word + 1).expand(rows, cols), torch.bitwise_right_shift(unsigned, 32 - shift, out=part))
    words = words[:, :-1]
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """fp4 bit codes (sign in bit 3) of a ``[rows, even cols]`` tensor, two a byte, low nibble
    first."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)
