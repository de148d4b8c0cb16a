"""Decode every code of a small format from its bit layout (independent of the quantizer).

Why: tests check that every quantizer output lies in the format's value set, so the set must come
from the encoding itself, not from the rounding code under test.
"""
from __future__ import annotations

import math


def decode_minifloat(code: int, ebits: int, mbits: int, *, ieee_like: bool,
                     nan_all_ones: bool) -> float:
    """Value of one sign|exponent|mantissa code (OCP/IEEE conventions)."""
    sign = -1.0 if (code >> (ebits + mbits)) & 1 else 1.0
    e = (code >> mbits) & ((1 << ebits) - 1)
    m = code & ((1 << mbits) - 1)
    bias = (1 << (ebits - 1)) - 1
    top = (1 << ebits) - 1
    if ieee_like and e == top:
        return sign * math.inf if m == 0 else math.nan
    if nan_all_ones and e == top and m == (1 << mbits) - 1:
        return math.nan
    if e == 0:
        return sign * m * 2.0 ** (1 - bias - mbits)
    return sign * (1 + m / (1 << mbits)) * 2.0 ** (e - bias)


def decode_hif8(code: int) -> float:
    """Value of one HiFloat8 byte: sign | dot prefix | exponent (sign-magnitude) | mantissa."""
    if code == 0x00:
        return 0.0
    if code == 0x80:
        return math.nan
    sign = -1.0 if code & 0x80 else 1.0
    if code & 0x7F == 0x6F:
        return sign * math.inf
    body = code & 0x7F  # 7 bits after the sign
    # dot prefix codes: 11 -> D=4, 10 -> D=3, 01 -> D=2, 001 -> D=1, 0001 -> D=0, 0000 -> denormal
    if body >> 5 == 0b11:
        d, rest_bits = 4, 5
    elif body >> 5 == 0b10:
        d, rest_bits = 3, 5
    elif body >> 5 == 0b01:
        d, rest_bits = 2, 5
    elif body >> 4 == 0b001:
        d, rest_bits = 1, 4
    elif body >> 3 == 0b0001:
        d, rest_bits = 0, 3
    else:  # 0000 + 3-bit M: denormal 2^(M-23)
        m = body & 0b111
        return sign * 2.0 ** (m - 23) if m else 0.0
    rest = body & ((1 << rest_bits) - 1)
    mbits = rest_bits - d
    mant = rest & ((1 << mbits) - 1)
    if d == 0:
        exp = 0
    else:
        ebits_field = rest >> mbits            # d bits: exponent sign + (d-1) magnitude bits
        esign = -1 if ebits_field >> (d - 1) else 1
        mag = (1 << (d - 1)) + (ebits_field & ((1 << (d - 1)) - 1))
        exp = esign * mag
    return sign * (1 + mant / (1 << mbits)) * 2.0 ** exp


def enumerate_values(spec) -> list[float]:
    """Sorted finite values of a format of 8 bits or fewer, decoded from all codes."""
    if spec.tapered:
        vals = [decode_hif8(c) for c in range(256)]
    elif spec.ebits == 0:  # fixed-point MX INT8, symmetric
        vals = [k * 2.0 ** -spec.mbits for k in range(-127, 128)]
    else:
        ieee_like = spec.has_inf
        vals = [decode_minifloat(c, spec.ebits, spec.mbits, ieee_like=ieee_like,
                                 nan_all_ones=spec.has_nan and not spec.has_inf)
                for c in range(1 << spec.bits)]
    finite = {v for v in vals if math.isfinite(v)}  # -0.0 == 0.0: one zero
    return sorted(finite)
