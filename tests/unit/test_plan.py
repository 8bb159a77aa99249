"""Plan validation and the rank map, without MPI."""

import re

import pytest

from fxpar.core.plan import Plan, PlanError, RankMap, Role


def test_defaults_are_the_trivial_plan():
    p = Plan()
    assert p.world_size == 1 and p.chunks() == 1 and not p.spatial and p.copies == 1
    assert RankMap(p).roles_of(0) == (Role(0, 0, 0),)


@pytest.mark.parametrize("kwargs, message", [
    (dict(stages=0), "Plan.stages must be an integer >= 1, got 0"),
    (dict(microbatches=2.5), "Plan.microbatches must be an integer >= 1, got 2.5"),
    (dict(spatial_parts=True), "Plan.spatial_parts must be an integer >= 1, got True"),
    (dict(schedule="zb"), "Plan.schedule must be one of ('gpipe', '1f1b', 'zero_bubble', "
                          "'interleaved_1f1b', 'zero_bubble_v'), got 'zb'"),
    (dict(slice="diagonal"), "Plan.slice must be one of ('vertical', 'horizontal', 'square', "
                             "'slab', 'pencil', 'cube')"),
    (dict(spatial_parts=4, spatial_stages=3, stages=2),
     "Plan.spatial_stages=3 exceeds stages=2: set spatial_stages <= stages"),
    (dict(gems_times=2), "Plan.gems_times > 1 needs gems=True"),
    (dict(stages=3, balance=[2, 2]), "Plan.balance has 2 entries but stages=3"),
    (dict(stages=2, balance=[2, 0]), "Plan.balance entries must be integers >= 1"),
    (dict(data_parallel=-1), "Plan.data_parallel must be an integer >= 1, got -1"),
    (dict(gems="yes"), "Plan.gems must be True or False"),
    (dict(compile="inductor"), "Plan.compile must be True or False, got 'inductor'"),
])
def test_invalid_plans_say_what_to_change(kwargs, message):
    with pytest.raises(PlanError) as e:
        Plan(**kwargs)
    assert message in str(e.value)


def test_plan_is_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        Plan(2)  # type: ignore[misc]
    p = Plan(stages=2)
    with pytest.raises(AttributeError):
        p.stages = 3  # type: ignore[misc]
    assert Plan(stages=2, balance=[3, 4]).balance == (3, 4)


@pytest.mark.parametrize("kwargs, world", [
    (dict(stages=4), 4),
    (dict(stages=2, spatial_parts=4), 5),            # 4 tiles of stage 0 + stage 1
    (dict(stages=1, spatial_parts=4), 4),            # pure SP: no extra rank
    (dict(stages=3, spatial_parts=2, spatial_stages=2), 5),
    (dict(stages=2, gems=True), 2),                  # the mirror reuses the same ranks
    (dict(stages=2, spatial_parts=4, data_parallel=3), 15),
    (dict(spatial_parts=9, slice="vertical"), 9),
])
def test_world_size(kwargs, world):
    assert Plan(**kwargs).world_size == world


def test_rank_map_flat_roles_and_gems_mirror():
    p = Plan(stages=3, spatial_parts=2, spatial_stages=1, gems=True, data_parallel=2)
    rm = RankMap(p)
    assert rm.roles == ((0, 0), (0, 1), (1, 0), (2, 0)) and rm.layout_size == 4
    assert rm.group(0, 0, 0) == (0, 1) and rm.group(0, 1, 0) == (3, 2)
    assert rm.rank_of(1, 0, 2) == 7 and rm.rank_of(1, 1, 2) == 4
    assert rm.roles_of(1) == (Role(0, 0, 1), Role(1, 1, 0))
    assert rm.roles_of(6) == (Role(0, 1, 0), Role(1, 0, 1)) and rm.dp_index(6) == 1
    # every (dp, copy, stage, tile) is played by exactly one rank
    seen = [(row["dp"], row["copy"], row["stage"], row["tile"]) for row in rm.describe()]
    assert len(seen) == len(set(seen)) == 2 * 2 * 4


def test_gems_odd_layout_puts_the_middle_role_twice_on_one_rank():
    rm = RankMap(Plan(stages=3, gems=True))
    assert rm.roles_of(1) == (Role(0, 1, 0), Role(1, 1, 0))


@pytest.mark.parametrize("slice_, parts, grid", [
    ("horizontal", 3, (3, 1)), ("vertical", 3, (1, 3)), ("square", 4, (2, 2)),
    ("square", 6, (2, 3)), ("square", 2, (1, 2)), ("square", 9, (3, 3)), ("square", 7, (1, 7)),
])
def test_tile_grid(slice_, parts, grid):
    assert Plan(spatial_parts=parts, slice=slice_).tile_grid() == grid


@pytest.mark.parametrize("slice_, parts, grid", [
    ("slab", 2, (2, 1, 1)), ("slab", 5, (5, 1, 1)), ("pencil", 4, (2, 2, 1)),
    ("pencil", 6, (2, 3, 1)), ("cube", 8, (2, 2, 2)), ("cube", 4, (1, 2, 2)),
    ("cube", 12, (2, 2, 3)), ("cube", 64, (4, 4, 4)), ("cube", 7, (1, 1, 7)),
    ("square", 4, (1, 2, 2)), ("horizontal", 3, (1, 3, 1)), ("vertical", 3, (1, 1, 3)),
])
def test_volume_tile_grid(slice_, parts, grid):
    assert Plan(spatial_parts=parts, slice=slice_).tile_grid(3) == grid


def test_image_slices_of_the_volume_names():
    for parts in (2, 4, 6, 8):
        assert Plan(spatial_parts=parts, slice="slab").tile_grid() == (parts, 1)
        for volume_only in ("pencil", "cube"):  # on an image: the square grid
            assert Plan(spatial_parts=parts, slice=volume_only).tile_grid() == \
                Plan(spatial_parts=parts).tile_grid()


def test_explicit_grid():
    plan = Plan(grid=(3, 1, 2))
    assert plan.spatial_parts == 6 and plan.tile_grid(3) == (3, 1, 2)
    assert Plan(grid=[2, 2], spatial_parts=4).grid == (2, 2)  # lists from JSON / CLI
    assert Plan(**Plan(grid=(2, 2, 2)).to_json()) == Plan(grid=(2, 2, 2))
    with pytest.raises(PlanError, match=r"Plan.grid=\(2, 2\) has 2 dims but the input is a "
                                        r"volume \(D, H, W\): give one tile count per"):
        Plan(grid=(2, 2)).tile_grid(3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(grid=(2, 2), spatial_parts=3), "Plan.grid=(2, 2) makes 4 tiles but spatial_parts=3"),
    (dict(grid=(2, 0, 2)), "Plan.grid must hold 1 to 3 integers >= 1, one per spatial dim"),
    (dict(grid=(1, 1, 1, 2)), "Plan.grid must hold 1 to 3 integers >= 1"),
    (dict(grid="2x2"), "Plan.grid must be a sequence of tile counts"),
])
def test_invalid_grids_say_what_to_change(kwargs, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        Plan(**kwargs)


def test_batch_must_split_into_equal_chunks():
    p = Plan(stages=2, microbatches=4, gems=True, data_parallel=2)
    assert p.chunks() == 16
    p.check_batch(32)
    with pytest.raises(PlanError, match="batch size 24 does not split into 16 equal chunks "
                       r"\(data_parallel=2 x 2 GEMS copies x gems_times=1 x microbatches=4\)"):
        p.check_batch(24)
