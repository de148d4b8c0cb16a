"""quant.quantizer.Quantizer: one configuration, validated once, called with tensors.

References: quant.quantize with the same options as keywords (the public path the other tests
hold to ml_dtypes, microxcaling and the Triton kernels), so a configured quantizer must give its
bits exactly.
"""
import pytest
import torch

import quant
from quant.quantizer import Quantizer


def _x(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 48, generator=g) * torch.exp2(
        torch.randint(-10, 10, (64, 48), generator=g).float())


def _same(a, b):
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("name,options", [
    ("mxfp8", dict(axis=0)), ("mxfp4", dict(scale_mode="rceil", block_size=16)),
    ("nvfp4", dict(axis=0)), ("hifp8", dict(rounding="nearest_even")),
    ("fp8_e5m2", dict(saturate=False)), ("fp8_e4m3_tensor", {}), ("fp32", {})])
def test_a_configured_quantizer_gives_quantizes_bits(name, options):
    x = _x()
    q = Quantizer.of(name, **options)
    want = quant.quantize(x, name, **options)
    _same(q(x), want)
    _same(quant.quantize(x, q), want)
    assert q.rounding == (options.get("rounding") or q.spec.default_rounding)


def test_along_is_the_same_configuration_on_another_axis():
    x = _x(1)
    q = Quantizer.of("mxfp6_e2m3", scale_mode="ceil")
    _same(q.along(0)(x), quant.quantize(x, "mxfp6_e2m3", scale_mode="ceil", axis=0))
    assert q.along(0) is q.along(0) and q.along(-1) is q and q.along(0).axis == 0


def test_stochastic_rounding_takes_the_generator_per_call():
    x = _x(2)
    q = Quantizer.of("mxfp4", rounding="stochastic")
    a = q(x, torch.Generator().manual_seed(5))
    b = quant.quantize(x, "mxfp4", rounding="stochastic", generator=torch.Generator().manual_seed(5))
    _same(a, b)
    with pytest.raises(TypeError, match="generator"):
        q(x, 5)


def test_options_beside_a_quantizer_are_refused():
    q = Quantizer.of("mxfp8")
    with pytest.raises(ValueError, match=r"\['axis'\]"):
        quant.quantize(torch.ones(4), q, axis=0)
    with pytest.raises(ValueError, match="analyze_quantization"):
        quant.analyze_quantization(torch.ones(4), q, block_size=16)


def test_validation_is_not_skipped_by_the_cache():
    assert Quantizer.of("mxfp8", block_size=1).block == 1
    with pytest.raises(ValueError, match="positive int"):
        Quantizer.of("mxfp8", block_size=True)       # equal to 1, but a bool
    with pytest.raises(ValueError, match="scale_mode"):
        Quantizer.of("nvfp4", scale_mode="ceil")
    with pytest.raises(ValueError, match="axis must be an int"):
        Quantizer.of("mxfp8", axis=1.0)
    with pytest.raises(ValueError, match="unknown quantization format"):
        Quantizer.of("mxfp9")


def test_built_directly_it_is_validated_and_resolved_too():
    q = Quantizer("hifp8")
    assert q == Quantizer.of("hifp8") and q.rounding == "nearest_away" and q.block == 0
    assert Quantizer("nvfp4", axis=0).block == 16
    with pytest.raises(ValueError, match="rounding"):
        Quantizer("mxfp8", rounding="bogus")
    with pytest.raises(ValueError, match="only applies to MX"):
        Quantizer("nvfp4", scale_mode="ceil")


def test_the_options_are_the_fields_and_nothing_else():
    """OPTIONS (quant.quantize's, Quantizer.of's and the analysis' keywords) is derived from the
    Quantizer's fields: each keyword sets its field, an unknown one is refused naming them all,
    and quant.quantize / analyze_quantization accept exactly these."""
    import dataclasses

    from quant.quantizer import OPTIONS

    fields = [f for f in dataclasses.fields(Quantizer) if f.init and f.name != "spec"]
    assert len(OPTIONS) == len(fields) and "block_size" in OPTIONS and "block" not in OPTIONS
    chosen = {"block_size": 16, "axis": 0, "rounding": "toward_zero", "scale_mode": "ceil",
              "saturate": False, "backend": "torch"}
    assert set(chosen) == set(OPTIONS)
    q = Quantizer.of("mxfp8", **chosen)
    assert (q.block, q.axis, q.rounding, q.scale_mode, q.saturate, q.backend) == (
        16, 0, "toward_zero", "ceil", False, "torch")
    x = _x(3)
    _same(quant.quantize(x, "mxfp8", **chosen), q(x))
    assert quant.analyze_quantization(x, "mxfp8", **chosen).block_size == 16
    for call in (lambda: Quantizer.of("mxfp8", block=16),
                 lambda: quant.quantize(x, "mxfp8", blocksize=16),
                 lambda: quant.analyze_quantization(x, "mxfp8", axes=0)):
        with pytest.raises(TypeError, match="the options are rounding, scale_mode, block_size"):
            call()
