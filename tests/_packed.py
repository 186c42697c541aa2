"""Codes of a compressed-tensors checkpoint's int4 weights, as its loader unpacks them."""

from __future__ import annotations

import torch


def packed_codes(tensors: dict, name: str) -> torch.Tensor:
    """The int4 codes of module ``name``: its ``weight_packed`` int32 words unpacked to ``weight_shape``
    (compressed-tensors' ``unpack_from_int32``)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    return unpack_from_int32(tensors[f"{name}.weight_packed"], 4, tuple(tensors[f"{name}.weight_shape"].tolist()))
