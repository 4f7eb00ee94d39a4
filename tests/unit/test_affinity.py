"""Hardware affinity (RollArt Listings 1-2): which workers a task tag may run on."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from loom.policies.affinity import eligible, gpu_for

AFFINITY = {"coding": "H800", "default": "h20"}


def test_a_tag_maps_to_its_entry_else_the_default_else_anywhere() -> None:
    assert gpu_for(AFFINITY, "coding") == "h800" and gpu_for(AFFINITY, "search") == "h20"
    assert gpu_for({"coding": "h800"}, "search") is None and gpu_for(None, "coding") is None
    gpus = ["h800", "h20", "H800", "h20"]
    assert eligible(gpus, AFFINITY, "coding") == [0, 2]
    assert eligible(gpus, AFFINITY, "math") == [1, 3]
    assert eligible(gpus, {"coding": "h800"}, "math") == [0, 1, 2, 3]
    assert eligible(["h800", "h800"], AFFINITY, "math") == [0, 1]  # no H20 at all: run anywhere


@given(
    gpus=st.lists(st.sampled_from(["h800", "h20", "a100"]), min_size=1, max_size=12),
    tag=st.sampled_from(["coding", "search", "math"]),
    affinity=st.dictionaries(
        st.sampled_from(["coding", "search", "default"]), st.sampled_from(["h800", "h20", "b200"]), max_size=3
    ),
)
def test_eligible_workers_are_the_mapped_type_or_all_of_them(
    gpus: list[str], tag: str, affinity: dict[str, str]
) -> None:
    got = eligible(gpus, affinity, tag)
    want = gpu_for(affinity, tag)
    mapped = [i for i, g in enumerate(gpus) if g == want]
    assert got == (mapped or list(range(len(gpus))))
