"""The mesh is a ``DeviceMesh`` with the axes ``dp`` / ``ring`` / ``ulysses``: on real gloo processes, for worlds of
4, 6 and 8 and every kind of shape (flat and hierarchical rings, Ulysses, DP > 1), each rank gets the coordinates
``g = d * SP + r * U + u`` and the groups of that formula (written out here, independently of the code), every
group works and carries the configured deadline; ``new_ring_groups`` builds the same rings from a list of ranks.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from ds_mtraining.parallel.comm import new_ring_groups
from ds_mtraining.parallel.mesh import AXES, Mesh, MeshShape

TIMEOUT = 7.5  # none of torch's or the project's defaults, so a group that missed it shows


def _expected(world: int, dp: int, ulysses: int, ring: int, inner: int, g: int) -> dict[str, list[int]]:
    """Global ranks of rank ``g``'s groups, straight from ``g = d * SP + r * U + u`` (sorted, as groups list them)."""
    sp = ulysses * ring
    d, r, u = g // sp, (g % sp) // ulysses, g % ulysses
    ring_ranks = [d * sp + i * ulysses + u for i in range(ring)]
    node = r // inner
    return {
        "coords": [d, r, u],
        "dp": [g % sp + k * sp for k in range(dp)],
        "sp": list(range(d * sp, (d + 1) * sp)),
        "ulysses": [d * sp + r * ulysses + j for j in range(ulysses)],
        "ring": ring_ranks,
        "inner": ring_ranks[node * inner : (node + 1) * inner],
        "outer": ring_ranks[r % inner :: inner],
        "model": [g],
    }


def _check(group: dist.ProcessGroup, ranks: list[int], what: str) -> None:
    """``group`` is over ``ranks``, has the deadline, and an all-reduce over it sums exactly those ranks."""
    assert dist.get_process_group_ranks(group) == ranks, (what, dist.get_process_group_ranks(group), ranks)
    timeout = group._get_backend(torch.device("cpu")).options._timeout
    assert timeout == timedelta(seconds=TIMEOUT), (what, timeout)
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total, group=group)
    assert int(total) == sum(ranks), (what, int(total), ranks)


def _worker(rank: int, world: int, cases, heads: tuple[int, int]) -> None:
    for ulysses, ring, inner_ring in cases:
        shape = MeshShape.build(
            world=world, ulysses=ulysses, ring=ring, q_heads=heads[0], kv_heads=heads[1], inner_ring=inner_ring
        )
        where = f"rank {rank}: {shape.describe()}"
        mesh = Mesh(shape, timeout_s=TIMEOUT)
        want = _expected(world, shape.dp, ulysses, ring, shape.inner_ring, rank)
        device_mesh = mesh.device_mesh
        assert device_mesh.mesh_dim_names == AXES and device_mesh.shape == (shape.dp, ring, ulysses), where
        # Same rank, same coordinates as before the mesh was a DeviceMesh (and as MeshShape.coords, which the batch
        # path's tests use without processes).
        assert list(device_mesh.get_coordinate()) == want["coords"] == list(shape.coords(rank)), where
        assert [mesh.dp_index, mesh.ring_rank, mesh.ulysses_rank] == want["coords"], where
        assert mesh.timeout_s == TIMEOUT
        _check(mesh.dp, want["dp"], f"dp, {where}")
        _check(mesh.sp, want["sp"], f"sp, {where}")
        _check(device_mesh["sp"].get_group(), want["sp"], f"device_mesh['sp'], {where}")
        _check(mesh.model, want["model"], f"model, {where}")
        if ulysses == 1:
            assert mesh.ulysses is None, where
        else:
            _check(mesh.ulysses, want["ulysses"], f"ulysses, {where}")
        if ring == 1:
            assert mesh.ring is None, where
            continue
        rings = {"mesh": mesh.ring}
        # The same ring from a list of ranks (one list per ring, every process creating every ring's groups).
        for start in range(world):
            if start == want["ring"][0]:
                rings["list"] = new_ring_groups(want["ring"], inner_ring, timeout_s=TIMEOUT)
            elif start % shape.sp < ulysses:
                others = [start + i * ulysses for i in range(ring)]
                with pytest.raises(ValueError, match=f"rank {rank} is not in the ring"):
                    new_ring_groups(others, inner_ring, timeout_s=TIMEOUT)
        for name, groups in rings.items():
            what = f"{name} ring, {where}"
            assert (groups.rank, groups.size, groups.inner_size) == (want["coords"][1], ring, shape.inner_ring), what
            _check(groups.ring, want["ring"], f"{what}, ring")
            _check(groups.inner, want["inner"], f"{what}, inner")
            if shape.hierarchical:
                assert groups.outer_size == ring // shape.inner_ring, what
                _check(groups.outer, want["outer"], f"{what}, outer")
            else:
                assert groups.outer is None and groups.inner is groups.ring, what


# (ulysses, ring, inner_ring_size)
CASES_4 = [(1, 4, None), (1, 4, 2), (1, 4, 1), (2, 2, None), (2, 2, 1), (4, 1, None), (1, 2, None), (2, 1, None)]
CASES_6 = [(1, 3, None), (3, 2, 1), (2, 3, None), (1, 2, None), (6, 1, None)]
CASES_8 = [(2, 2, 1), (2, 4, 2), (1, 4, 2), (1, 8, 4), (1, 1, None)]


@pytest.mark.parametrize(
    "world,cases,heads",
    [
        pytest.param(4, CASES_4, (4, 2), id="world-4"),
        pytest.param(6, CASES_6, (12, 6), id="world-6"),
        pytest.param(8, CASES_8, (8, 2), id="world-8"),
    ],
)
def test_mesh_groups_follow_the_rank_formula(world, cases, heads):
    run_distributed(world, _worker, cases, heads, timeout=240)


def test_inner_ring_size_is_checked_before_any_group_is_made():
    # No process group exists here: the check must come first, or this would fail on the missing default group.
    with pytest.raises(ValueError, match="inner ring size 3 must divide the ring size 4"):
        new_ring_groups([0, 1, 2, 3], 3)
