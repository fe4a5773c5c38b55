"""The Muon benchmark's workloads: matrices only, and GPT-2 small's hidden matrices in both
layouts (c_attn whole, or split into query, key and value)."""
from mtapply.bench import muon
from mtapply.bench.workloads import WORKLOADS, count_params


def test_default_workloads_have_targets_and_hold_matrices_only():
    assert set(muon.TARGETS) == set(muon.DEFAULT_WORKLOADS)
    for name in muon.DEFAULT_WORKLOADS:
        assert all(len(shape) == 2 for shape in WORKLOADS[name]()), name


def test_gpt2_hidden72_splits_c_attn_into_three_squares():
    whole, split = WORKLOADS["gpt2-hidden"](), WORKLOADS["gpt2-hidden72"]()
    assert (len(whole), len(split)) == (48, 72)
    assert count_params(whole) == count_params(split)
    assert sorted(set(split)) == [(768, 768), (768, 3072), (3072, 768)]
    assert split.count((768, 768)) == 48
