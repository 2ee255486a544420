"""mixprec._tree.map_tensors: the one walker over nested tensors, against plain Python expectations."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch

from mixprec._tree import map_tensors

Pair = namedtuple("Pair", "a b")


def double(tensor: torch.Tensor) -> torch.Tensor:
    return tensor * 2


def test_containers_keep_their_types_and_keys():
    a, b = torch.ones(1), torch.full((1,), 3.0)
    out = map_tensors({"x": [a, (b, Pair(a, b))], "y": OrderedDict(z=b)}, double)
    assert type(out["y"]) is OrderedDict and list(out) == ["x", "y"]
    assert isinstance(out["x"][1][1], Pair) and out["x"][1][1].b.item() == 6.0
    assert out["x"][0].item() == 2.0 and out["y"]["z"].item() == 6.0


def test_unchanged_containers_are_returned_themselves():
    value = [torch.ones(1), {"k": (1, "s")}]
    assert map_tensors(value, lambda tensor: tensor) is value


def test_memo_maps_a_shared_tensor_once():
    shared, calls = torch.ones(1), []

    def record(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(tensor)
        return tensor * 2

    out = map_tensors((shared, [shared]), record, memo={})
    assert len(calls) == 1 and out[0] is out[1][0]
    assert map_tensors((shared, shared), double)[0] is not map_tensors((shared, shared), double)[1]


def test_strict_maps_other_iterables_lazily_and_refuses_other_leaves():
    out = map_tensors(iter([torch.ones(1)]), double, strict=True)
    assert isinstance(out, map) and next(out).item() == 2.0
    assert map_tensors([torch.ones(1), 5], double)[1] == 5  # not strict: leaves pass through
    with pytest.raises(ValueError, match="got int: 5"):
        map_tensors([torch.ones(1), 5], double, strict=True)


def test_a_dict_type_that_refuses_update_is_mapped_item_by_item():
    class Output(OrderedDict):  # as transformers' ModelOutput
        def update(self, *args, **kwargs):
            raise RuntimeError("no update")

    out = map_tensors(Output(loss=torch.ones(())), double)
    assert type(out) is Output and out["loss"].item() == 2.0
