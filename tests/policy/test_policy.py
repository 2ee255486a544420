"""Policy as data: defaults, edits, module overrides, parsing and its round trip."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec
from mixprec import Policy
from mixprec.policy import POLICY_PRESETS, ops

DTYPE_SPELLINGS = {
    torch.float32: ["float32", "fp32", "f32", "float", "torch.float32"],
    torch.bfloat16: ["bfloat16", "bf16", "BF16"],
    torch.float16: ["float16", "fp16", "f16", "half"],
}


@pytest.mark.parametrize("family, table", [("cpu", ops.CPU_OPS), ("cuda", ops.CUDA_OPS)])
def test_default_policy_is_the_catalogue(family: str, table: dict) -> None:
    lists = Policy.for_device(family).ops()
    for category, names in table.items():
        assert names <= lists[category], category
    for name, category in ops.COMPOSITES.get(family, {}).items():
        assert name in lists[category]


def test_default_dtypes_follow_torch() -> None:
    assert Policy.for_device("cpu").resolve("cpu").compute_dtype == torch.get_autocast_dtype("cpu")
    assert Policy.for_device("cuda").resolve("cuda").compute_dtype == torch.float16


def test_with_ops_moves_ops_and_leaves_the_original() -> None:
    base = Policy.for_device("cpu", torch.bfloat16)
    edited = base.with_ops(fp32=["linear"], lower=["gelu"], promote=["add"])  # gelu, add: unlisted by default
    assert edited.category("add") == "promote"
    assert base.category("linear") == "lower" and edited.category("linear") == "fp32"
    assert edited.category("gelu") == "lower"
    again = edited.with_ops(none=["linear"])
    assert again.category("linear") == "none" and "linear" not in again.ops()["lower"]
    reordered = base.with_ops(promote=["add"]).with_ops(lower=["gelu"]).with_ops(fp32=["linear"])
    assert edited == reordered  # the order of edits is irrelevant
    assert hash(edited) == hash(reordered)


def test_aliases_resolve_to_catalogue_names() -> None:
    policy = Policy.for_device("cpu").with_ops(fp32=["__matmul__"])
    assert policy.category("matmul") == "fp32"


def test_unknown_op_suggests_close_names() -> None:
    with pytest.raises(ValueError, match=r"unknown op 'softmaxx' \(did you mean 'softmax'"):
        Policy().with_ops(fp32=["softmaxx"])
    with pytest.raises(ValueError, match="both 'lower' and 'fp32'"):
        Policy().with_ops(lower=["linear"], fp32=["linear"])
    with pytest.raises(TypeError, match="name or a callable"):
        Policy().with_ops(fp32=[3])  # type: ignore[list-item]


def test_callables_are_ops_too() -> None:
    def my_op(t: torch.Tensor) -> torch.Tensor:
        return t

    policy = Policy.for_device("cpu").with_ops(fp32=[my_op])
    assert policy.category(my_op) == "fp32"
    assert "<" in str(policy)  # shown, though a callable cannot round-trip through a string


def test_module_overrides_match_names_globs_classes_filters() -> None:
    norm = nn.LayerNorm(4)
    policy = Policy().with_modules(
        {
            "encoder.*.norm": torch.float32,
            nn.Linear: "bf16",
            (lambda m, name: name.startswith("head")): Policy.preset("16-mixed"),
        }
    )
    assert policy.module_override(norm, "encoder.3.norm") == torch.float32
    assert policy.module_override(norm, "decoder.3.norm") is None
    assert policy.module_override(nn.Linear(2, 2), "x") == torch.bfloat16
    assert policy.module_override(nn.ReLU(), "head.act") == Policy.preset("16-mixed")
    with pytest.raises(TypeError, match="not an nn.Module subclass"):
        Policy().with_modules({int: torch.float32})
    with pytest.raises(ValueError, match="float64"):
        Policy().with_modules({"a": torch.float64})
    with pytest.raises(ValueError, match="unknown dtype 'fp33'"):
        Policy().with_modules({"a": "p=fp33"})


def test_presets() -> None:
    assert Policy.preset("bf16-mixed").compute_dtype == torch.bfloat16
    assert Policy.preset("16-mixed").compute_dtype == torch.float16
    for family in ("cpu", "cuda"):
        conservative = Policy.preset("conservative", family)
        for name in ("softmax", "layer_norm", "sum"):
            assert conservative.category(name) == "fp32", (family, name)
    with pytest.raises(ValueError, match="did you mean 'conservative'"):
        Policy.preset("conservativ")


@pytest.mark.parametrize(
    ("spelling", "preset"),
    [("fp16-mixed", "16-mixed"), ("fp16", "16-mixed"), ("half", "16-mixed"), ("bf16", "bf16-mixed"),
     ("bfloat16-mixed", "bf16-mixed")],
)  # fmt: skip
def test_a_preset_has_one_name_lightnings(spelling: str, preset: str) -> None:
    """Presets take Lightning's precision names only (as mixprec.PRESETS): other spellings of the same dtype
    are refused with the preset meant and the accepted names, everywhere a policy string is taken."""
    assert POLICY_PRESETS == ("bf16-mixed", "16-mixed", "conservative")
    assert set(POLICY_PRESETS) - {"conservative"} <= set(mixprec.PRESETS)
    accepted = r"accepted: \['bf16-mixed', '16-mixed', 'conservative'\]"
    refused = rf"unknown policy preset '{spelling}' \(did you mean '{preset}'\?.*{accepted}"
    for parse in (Policy.preset, Policy.parse, lambda s: mixprec.autocast("cpu", policy=s)):
        with pytest.raises(ValueError, match=refused):
            parse(spelling)
    assert Policy.preset(preset.upper()) == Policy.parse(f" {preset} ")  # case and blanks only
    assert Policy.preset(preset).compute_dtype == mixprec.PRESETS[preset][1]


def test_parse_long_and_short_forms() -> None:
    long = Policy.parse("params=float32,compute=bfloat16,output=float32")
    short = Policy.parse("p=f32,c=bf16,o=f32")
    assert long == short == Policy(compute_dtype=torch.bfloat16)
    assert str(long) == "params=float32,compute=bfloat16,output=float32"
    with pytest.raises(ValueError, match="unknown policy key 'comptue'.*'compute'"):
        Policy.parse("comptue=bf16")
    with pytest.raises(ValueError, match="unknown dtype 'bf61'"):
        Policy.parse("c=bf61")
    with pytest.raises(ValueError, match="not key=value"):
        Policy.parse("c=bf16,junk")
    with pytest.raises(ValueError, match="unknown op list 'slow'"):
        Policy.parse("c=bf16,slow+=linear")
    with pytest.raises(ValueError, match="device_type"):
        Policy.parse("c=bf16,device=tpu")


NAMES = sorted(ops.ALL_OP_NAMES)
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    policy = Policy(
        compute_dtype=draw(st.one_of(st.none(), dtypes)),
        param_dtype=draw(dtypes),
        output_dtype=draw(dtypes),
        device_type=draw(st.sampled_from([None, "cpu", "cuda"])),
    )
    for _ in range(draw(st.integers(0, 4))):
        category = draw(st.sampled_from(["lower", "fp32", "promote", "none"]))
        names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
        policy = policy.with_ops(**{category: names})
    return policy


@settings(max_examples=200, deadline=None)
@given(policies())
def test_string_form_round_trips(policy: Policy) -> None:
    assert Policy.parse(str(policy)) == policy


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(list(DTYPE_SPELLINGS)), st.data())
def test_every_dtype_spelling_parses(dtype: torch.dtype, data: st.DataObject) -> None:
    spelling = data.draw(st.sampled_from(DTYPE_SPELLINGS[dtype]))
    key = data.draw(st.sampled_from(["compute", "c", "params", "p", "output", "o"]))
    policy = Policy.parse(f"{key}={spelling}")
    field = {"c": "compute_dtype", "p": "param_dtype", "o": "output_dtype"}[key[0]]
    assert getattr(policy, field) == dtype


@settings(max_examples=100, deadline=None)
@given(policies(), st.sampled_from(NAMES), st.sampled_from(["lower", "fp32", "promote", "none"]))
def test_moved_op_lands_in_its_list_and_nowhere_else(policy: Policy, name: str, category: str) -> None:
    moved = policy.with_ops(**{category: [name]})
    canonical = ops.ALIASES.get(name, name)
    for family in ("cpu", "cuda"):
        assert moved.category(canonical, family) == category
        lists = moved.ops(family)
        assert sum(canonical in members for members in lists.values()) == (category != "none")


def test_pins_round_trip_through_the_string_form() -> None:
    policy = Policy(compute_dtype=torch.bfloat16).with_modules(
        {"encoder.*.norm": torch.float32, nn.LayerNorm: "fp32", "head": torch.bfloat16}
    )
    text = str(policy)
    assert "pins=encoder.*.norm:float32|nn.LayerNorm:float32|head:bfloat16" in text
    assert Policy.parse(text) == policy
    assert Policy.parse("c=bf16,pins=head:fp32") == Policy(compute_dtype=torch.bfloat16).with_modules(
        {"head": torch.float32}
    )


def test_pins_without_a_text_form_are_counted_and_refused_by_parse() -> None:
    policy = Policy().with_modules({"head": torch.float32, (lambda module, name: False): torch.float32})
    assert str(policy).endswith("pins=head:float32,unprintable=1")
    with pytest.raises(ValueError, match="unprintable=1.*with_modules"):
        Policy.parse(str(policy))


@pytest.mark.parametrize(
    "text, match",
    [
        ("pins=head", "not NAME:DTYPE"),
        ("pins=nn.NoSuchLayer:fp32", "no module class 'NoSuchLayer'"),
        ("pins=head:int8", "head"),
    ],
)
def test_bad_pins_are_refused_by_name(text: str, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        Policy.parse(text)
