"""The compressor registry: specs by name, canonical ``spec`` strings that round-trip exactly."""
import pickle

import pytest
import torch

import gradcomp
from gradcomp.compressors import BF16, FP16, Compressor, Identity, TopK, TwoBit, from_spec, registered, spec_name

SPECS = {
    "topk:0.01": (TopK, "topk:0.01"),
    "topk:density=0.01": (TopK, "topk:0.01"),
    " TopK : 1e-3 ": (TopK, "topk:0.001"),
    "topk:1": (TopK, "topk:1.0"),
    "topk": (TopK, "topk:0.01"),
    "topk:0.02,entries=compact": (TopK, "topk:0.02,entries=compact"),
    "topk:0.01,entries=wide": (TopK, "topk:0.01"),  # a setting at its default is left out of the spec
    "twobit:0.5": (TwoBit, "twobit:0.5"),
    "twobit:threshold=0.5": (TwoBit, "twobit:0.5"),
    "twobit:0.02": (TwoBit, "twobit:0.019999999552965164"),  # the float32 the kernels compare with
    "twobit:rms": (TwoBit, "twobit:rms"),
    "fp16": (FP16, "fp16"),
    "bf16": (BF16, "bf16"),
    "identity": (Identity, "identity"),
}


@pytest.mark.parametrize("text", SPECS, ids=repr)
def test_from_spec_builds_the_named_compressor_with_a_canonical_spec(text):
    cls, canonical = SPECS[text]
    compressor = from_spec(text)
    assert type(compressor) is cls
    assert compressor.spec == canonical
    again = from_spec(compressor.spec)
    assert type(again) is cls and again.spec == canonical and repr(again) == repr(compressor)


def test_the_known_names_are_registered_once():
    assert set(registered()) == {"topk", "twobit", "threebit", "identity", "fp16", "bf16"}
    assert registered()["topk"] is TopK
    spec_name("topk", params=("density",))(TopK)  # the same class again: a no-op
    with pytest.raises(ValueError, match="already registered"):
        spec_name("topk")(FP16)
    with pytest.raises(ValueError, match="lower-case"):
        spec_name("Top K")


@pytest.mark.parametrize("seed", range(20))
def test_spec_round_trips_exactly_for_any_setting(seed):
    generator = torch.Generator().manual_seed(seed)
    density = float(torch.rand((), generator=generator, dtype=torch.float64)) or 1.0
    threshold = float(torch.rand((), generator=generator, dtype=torch.float64) * 10 ** int(seed % 7 - 3)) or 1.0
    for compressor in (TopK(density), TwoBit(threshold)):
        rebuilt = from_spec(compressor.spec)
        assert rebuilt.spec == compressor.spec
        # Same settings bit for bit, so every rank computes the same layout and codes.
        if isinstance(compressor, TopK):
            assert rebuilt.density == compressor.density and rebuilt.k(10**9 + 7) == compressor.k(10**9 + 7)
        else:
            assert rebuilt.threshold == compressor.threshold


def test_spec_survives_pickle_and_is_a_plain_string():
    compressor = pickle.loads(pickle.dumps(TopK(0.003)))
    assert compressor.spec == "topk:0.003" and type(compressor.spec) is str


@pytest.mark.parametrize(
    "text, match",
    [
        ("topkk:0.01", r"unknown compressor 'topkk'.*known: bf16, fp16, identity, threebit, topk, twobit"),
        ("", "unknown compressor ''"),
        ("topk:", "nothing after ':'"),
        ("topk:0.1,,", "empty argument"),
        ("topk:density=0.1,0.2", "positional argument"),
        ("topk:density=0.1,density=0.2", "given twice"),
        ("topk:x y", "cannot read 'x y'"),
        ("topk:2", r"fraction of entries kept.*must be finite and in \(0, 1\]"),
        ("topk:nan", "must be finite"),
        ("topk:0.1,0.2", "positional"),
        ("topk:size=3", "unexpected keyword argument 'size'"),
        ("topk:ratio=0.1", "unexpected keyword argument 'ratio'"),  # one name: density
        ("twobit:0", "threshold must be finite and > 0"),
        ("twobit:fast", "threshold"),
        ("fp16:1", "fp16 takes no arguments"),
    ],
)
def test_bad_specs_say_what_is_wrong(text, match):
    with pytest.raises(ValueError, match=match):
        from_spec(text)


def test_from_spec_passes_compressors_through_and_rejects_other_types():
    compressor = TopK(0.1)
    assert from_spec(compressor) is compressor
    with pytest.raises(TypeError, match="a compressor spec is a string"):
        from_spec(0.01)


def test_unregistered_classes_have_no_spec():
    class Halved(TopK):
        pass

    class Custom(Compressor):
        pass

    with pytest.raises(TypeError, match="Halved is not in the compressor registry"):
        Halved(0.1).spec
    with pytest.raises((TypeError, AttributeError)):
        Custom().spec


def test_density_is_the_one_name():
    assert TopK(0.05).density == TopK(density=0.05).density == 0.05
    assert repr(TopK(0.05)) == "TopK(density=0.05)" and TopK().density == 0.01
    with pytest.raises(TypeError, match="ratio"):
        TopK(ratio=0.05)
    assert not hasattr(TopK(0.05), "ratio")


def test_package_exports():
    assert gradcomp.compressors.from_spec is from_spec
    assert gradcomp.from_spec is from_spec and "from_spec" in gradcomp.__all__
