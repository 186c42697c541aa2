"""torchao's affine quantization of a tensor through its own ``quant_primitives``: the reference that the
tests of convention="torchao" compare scales, zero points, codes and values with, case by case.
Importing it skips the test module where torchao is not installed."""

import pytest

qp_lib = pytest.importorskip("torchao.quantization.quant_primitives")

NO_CAST = {  # zero-point domain: torchao's quantize before the final dtype cast, dequantize without dtype check
    "INT": (qp_lib._quantize_affine_no_dtype_cast, qp_lib._dequantize_affine_no_dtype_check),
    "NONE": (qp_lib._quantize_affine_no_zero_point_no_dtype_cast, qp_lib._dequantize_affine_no_zero_point_no_dtype_check),
    "FLOAT": (qp_lib._quantize_affine_tinygemm_no_dtype_cast, qp_lib._dequantize_affine_tinygemm_no_dtype_check),
}


def torchao_qparams(x, target, mapping, domain, block_size, preserve_zero=True, **kwargs) -> tuple:
    """torchao's scale and zero point (None in the zero-point domain "NONE") of ``x``: tinygemm's
    ``choose`` in the domain "FLOAT", else the ``dont_preserve_zero`` one where zero need not be exact,
    else ``choose_qparams_affine``."""
    if domain == "FLOAT":
        choose = qp_lib._choose_qparams_affine_tinygemm
    elif not preserve_zero:
        choose = qp_lib._choose_qparams_affine_dont_preserve_zero
    else:
        choose = qp_lib.choose_qparams_affine
    scale, zero_point = choose(x, mapping, block_size, target, **kwargs)
    return scale, None if domain == "NONE" else zero_point


def torchao_affine(x, target, mapping, domain, block_size, preserve_zero=True, **kwargs) -> tuple:
    """torchao's scale, zero point (None for "NONE"), integer codes and values in ``x.dtype``."""
    scale, zero_point = torchao_qparams(x, target, mapping, domain, block_size, preserve_zero, **kwargs)
    qmin, qmax = qp_lib._get_and_check_qmin_qmax(target, kwargs.get("quant_min"), kwargs.get("quant_max"))
    quantize, dequantize = NO_CAST[domain]
    codes = quantize(x, block_size, scale, zero_point, qmin, qmax)
    return scale, zero_point, codes, dequantize(codes, block_size, scale, zero_point, qmin, qmax, x.dtype)
