"""lowp-attribute's arithmetic on synthetic numbers: gaps and their noise, shares closed,
the ablation sets, their cost, bisection halves, the plans they become, the report."""
from __future__ import annotations

import math
import random

import pytest

from attribution import ablations as ab
from attribution import report, stats
from attribution.attribute import Attribution, Measured

TINY = ab.ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=172, num_attention_heads=4,
                     num_query_groups=2, seq_length=64, vocab_size=512)


def test_t_test_tells_a_gap_from_seed_noise():
    assert stats.t_critical(2) == pytest.approx(4.303)
    assert stats.t_critical(100) == 1.96 and stats.t_critical(0) == math.inf
    s = stats.summarize([0.5, 0.6, 0.55])
    assert s.mean == pytest.approx(0.55) and s.std == pytest.approx(0.05)
    assert s.significant
    noisy = stats.summarize([0.05, -0.04, 0.02])    # mean 0.01, spread 0.046
    assert not noisy.significant and not noisy.nonzero
    assert stats.summarize([-0.5, -0.6, -0.55]).nonzero
    assert not stats.summarize([-0.5, -0.6, -0.55]).significant
    assert not stats.summarize([1.0]).significant        # one seed: no noise estimate
    assert stats.summarize([1.0, float("nan"), 2.0]).n == 2


def test_closure_is_paired_by_seed_and_in_units_of_the_gap():
    ref = {1: 4.0, 2: 5.0, 3: 4.5}          # seeds differ a lot in absolute loss ...
    fmt = {1: 5.0, 2: 6.1, 3: 5.4}          # ... the paired gap is ~1
    half = {1: 4.5, 2: 5.5, 3: 4.95}
    c = stats.closure(fmt, ref, half)
    gap = stats.gap_summary(fmt, ref)
    assert gap.mean == pytest.approx(1.0) and gap.significant
    assert c.share == pytest.approx((0.5 + 0.6 + 0.45) / 3 / 1.0)
    assert c.share_std == pytest.approx(stats.summarize([0.5, 0.6, 0.45]).std / 1.0)
    assert c.significant
    assert stats.closure(fmt, ref, fmt).share == 0
    assert stats.closure(fmt, ref, ref).share == pytest.approx(1.0)
    assert math.isnan(stats.closure(fmt, fmt, ref).share)        # no gap: no share


def test_within_noise_compares_two_gaps_by_their_standard_errors():
    a = stats.summarize([0.10, 0.12, 0.08])
    assert stats.within_noise(a, stats.summarize([0.11, 0.09, 0.13]))
    assert not stats.within_noise(a, stats.summarize([0.50, 0.52, 0.48]))


def test_standard_ablations_cover_roles_and_layer_groups_without_duplicates():
    abl = ab.standard_ablations(TINY)
    names = [a.name for a in abl]
    assert names[:4] == ["fprop (all layers)", "dgrad (all layers)", "wgrad (all layers)",
                         "backward: dgrad+wgrad (all layers)"]
    assert {"first 1 layer", "last 1 layer", "attention (all layers)", "MLP (all layers)",
            "output layer"} <= set(names)
    assert "layer 0" not in names                  # the same atoms as "first 1 layer"
    assert len({a.atoms for a in abl}) == len(abl)
    deep = ab.standard_ablations(ab.ModelShape(16, 2048, 8192, 32, 8, 2048, 128256))
    assert {"first 2 layers", "last 2 layers", "layers 0-3", "layers 12-15"} <= {
        a.name for a in deep}
    back = next(a for a in abl if a.name.startswith("backward"))
    assert back.describe(TINY) == {"roles": ["dgrad", "wgrad"], "layers": "all",
                                   "modules": "all"}


def test_costs_are_flop_shares_that_add_up():
    roles = [ab.cost(a.atoms, TINY) for a in ab.standard_ablations(TINY)[:3]]
    assert sum(roles) == pytest.approx(1.0)
    assert roles[0] > roles[1] == pytest.approx(roles[2])    # fprop also has Q·Kᵀ and P·V
    assert ab.cost(TINY.atoms(), TINY) == pytest.approx(1.0)


def test_bisection_halves_by_role_then_layers_then_unit_kind():
    atoms = TINY.atoms()
    first = ab.splits(atoms, TINY)
    assert [{a[2] for a in h} for h in first[0]] == [{"fprop"}, {"dgrad", "wgrad"}]
    back = first[0][1]
    by_role, by_layer, *_ = ab.splits(back, TINY)
    assert [{a[2] for a in h} for h in by_role] == [{"dgrad"}, {"wgrad"}]
    assert {a[1] for a in by_layer[0]} == {0} and {a[1] for a in by_layer[1]} == {1, None}
    one = frozenset({("mlp", 1, "wgrad")})
    assert ab.splits(one, TINY) == []
    for lo, hi in ab.splits(atoms, TINY):
        assert lo | hi == atoms and not lo & hi


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_of_any_atom_set_keeps_exactly_those_gemms_in_the_reference(seed):
    rng = random.Random(seed)
    every = sorted(TINY.atoms(), key=str)
    atoms = frozenset(rng.sample(every, rng.randint(1, len(every))))
    plan = ab.plan_for(atoms, "fp8_e4m3", "bf16", TINY)
    paths = {ab.ATTENTION: ("self_attention.linear_qkv", "self_attention.linear_proj",
                            "self_attention.core_attention"),
             ab.MLP: ("mlp.linear_fc1", "mlp.linear_fc2")}
    for kind, layer, role in every:
        for sub in paths.get(kind, ("",)):
            path = "output_layer" if kind == ab.OUTPUT else f"decoder.layers.{layer}.{sub}"
            want = "bf16" if (kind, layer, role) in atoms else "fp8_e4m3"
            assert plan.format_for(path, layer, role) == want, (path, role)


def _result(fmt_gap: float, closes: dict, noise: float = 0.01, seeds=(1, 2, 3)):
    rng = random.Random(0)
    base = {s: 4.0 + 0.3 * s for s in seeds}
    ref = Measured("reference bf16", None, dict(base))
    low = Measured("format x", None, {s: base[s] + fmt_gap + rng.gauss(0, noise) for s in seeds})
    res = Attribution("x", "bf16", 100, list(seeds), TINY, 0.9, ref, low)
    for a in ab.standard_ablations(TINY):
        share = closes.get(a.name, 0.0)
        res.ablations.append(Measured(a.name, a.atoms, {
            s: low.losses[s] - share * fmt_gap + rng.gauss(0, noise) for s in seeds}))
    return res


def test_report_and_json_on_a_synthetic_attribution(tmp_path):
    res = _result(1.0, {"backward: dgrad+wgrad (all layers)": 0.97, "wgrad (all layers)": 0.8})
    res.plan_atoms = next(a.atoms for a in res.ablations if a.name.startswith("backward"))
    out = report.to_json(res)
    assert out["significant"] and out["gap"]["mean"] == pytest.approx(1.0, abs=0.05)
    rows = {a["name"]: a for a in out["ablations"]}
    assert rows["backward: dgrad+wgrad (all layers)"]["gap_closed"] == pytest.approx(0.97, abs=.05)
    assert rows["fprop (all layers)"]["high_precision"] == {"roles": ["fprop"], "layers": "all",
                                                           "modules": "all"}
    assert report.verdict(res, res.ablations[0]) == "within noise"
    assert report.verdict(res, res.ablations[3]) == "closes >= 90%"
    text = report.table(res)
    assert "significant" in text and "backward: dgrad+wgrad" in text
    assert report.figure(res, tmp_path / "f.png").stat().st_size > 10_000


def test_a_gap_within_noise_is_reported_as_not_significant_with_no_attribution(tmp_path):
    res = _result(0.002, {"fprop (all layers)": 1.0}, noise=0.02)
    assert not res.significant
    out = report.to_json(res)
    assert out["significant"] is False and out["ablations"] == [] and out["plan"] is None
    assert "no significant gap" in report.table(res)
    assert report.figure(res, tmp_path / "f.png") is None
