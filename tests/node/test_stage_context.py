"""stage_context (meshnet_node.backends): the node's fast way to a StageContext."""

from __future__ import annotations

import dataclasses

import pytest

from meshnet_node.backends import StageContext, stage_context


@pytest.mark.parametrize(
    "values",
    [
        ("s", 7, 1, 0, 1, 3, 12.5, None, (), None, 1, None),
        ("t", 0, 32, 2, 4, 0, None, "ab" * 16, ("cd" * 16, "ef" * 16), "01" * 16, 32, 40),
    ],
)
def test_equal_to_constructing_it(values: tuple) -> None:  # type: ignore[type-arg]
    names = [field.name for field in dataclasses.fields(StageContext)]
    built = StageContext(**dict(zip(names, values, strict=True)))
    fast = stage_context(*values)
    assert fast == built and hash(fast) == hash(built) and repr(fast) == repr(built)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.position = 8  # type: ignore[misc]
