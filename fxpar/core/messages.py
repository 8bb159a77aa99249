"""The point-to-point messages of one action, as data: peer, MPI tag, shape.

One pure function, :func:`messages`, says what a SEND_F / RECV_F / SEND_B / RECV_B action of a
rank exchanges: the runtime (fxpar.runtime.loop) posts exactly these, and the compiler
(fxpar.core.lowering) simulates every rank's list of them before anything runs, so the two can
never disagree on a tag or a shape.

Tags: one per (direction, copy, micro-batch, transfer) of a step, so MPI's matching on
(source, tag) never confuses two messages::

    tag = ((2 * copy + backward) * microbatches + mb) * transfers + transfer.id

MPI guarantees tags up to 32767 (``MPI_TAG_UB`` may be larger): :func:`max_p2p_tag` gives the
largest one a plan uses, checked at compile time and again against the real bound when the
communicator is made.

Transfer kinds (a spatial stage's tiles, P of them, talk to a later stage)::

    p2p         plain stage -> stage
    tile        spatial -> spatial: tile t -> tile t
    gather      a tiled tensor leaves the spatial stages: every tile -> one rank
    replicated  a whole value every tile holds leaves: tile 0 sends it (its gradient returns
                to tile 0 only)
"""

from __future__ import annotations

from dataclasses import dataclass

from fxpar.core.geometry import Grid, Rect
from fxpar.core.plan import Plan, PlanError
from fxpar.core.schedule import Action
from fxpar.core.stages import StageGraph, Transfer

MPI_TAG_UB_MIN = 32767
"""The smallest ``MPI_TAG_UB`` the MPI standard allows: every MPI accepts tags up to this."""


def p2p_tag(t: Transfer, copy: int, mb: int, backward: bool, microbatches: int,
            transfers: int) -> int:
    """The MPI tag of transfer ``t`` of micro-batch ``mb`` of model ``copy`` (forward data or,
    ``backward``, its gradient); ``transfers``: transfers per model copy."""
    return (((2 * copy + int(backward)) * microbatches + mb) * transfers) + t.id


def max_p2p_tag(copies: int, microbatches: int, transfers: int) -> int:
    """The largest tag :func:`p2p_tag` gives (-1 when there are no transfers)."""
    return 2 * copies * microbatches * transfers - 1


def _rect(grid: Grid, t: Transfer, tile: int) -> Rect:
    return grid.tile_rect(tuple(t.shape[2:]), tile)


def _tile_shape(grid: Grid, t: Transfer, tile: int) -> tuple[int, ...]:
    return (*t.shape[:2], *_rect(grid, t, tile).shape)


def transfer_kind(t: Transfer, spatial_stages: int) -> str:
    """p2p, tile, gather or replicated (see the module doc); ``spatial_stages`` 0: none."""
    if t.src >= spatial_stages:
        return "p2p"
    if t.dst < spatial_stages:
        return "tile"
    return "gather" if t.tiled else "replicated"


@dataclass(frozen=True)
class Message:
    """One message an action sends or receives."""

    send: bool
    transfer: Transfer
    stage: int
    """The peer's stage (same copy, same data-parallel replica)."""
    tile: int
    """The peer's tile (0 outside the spatial stages)."""
    tag: int
    shape: tuple[int, ...]
    rect: Rect | None = None
    """A piece of a gathered tensor: where it sits in the whole tensor (None: the message is
    the whole value, or this rank's tile of it)."""


def messages(a: Action, graph: StageGraph, microbatches: int, grid: Grid | None = None,
             spatial_stages: int = 0, tile: int = 0) -> list[Message]:
    """What ``a`` (SEND_F, RECV_F, SEND_B or RECV_B; any other kind: nothing) exchanges, in the
    order the runtime posts it. ``microbatches``: per model copy per step (GEMS rounds
    included); ``grid``, ``spatial_stages``: the spatial layout (None, 0: none); ``tile``: the
    rank's tile in ``a``'s copy (0 outside the spatial stages)."""
    if a.kind not in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
        return []
    backward = a.kind.endswith("_B")
    n = len(graph.transfers)
    mine = tile  # this rank's tile (the peer's is "tile" below)
    if grid is None:
        spatial_stages = 0
    out: list[Message] = []
    # forward data goes from t.src to t.dst; gradients come back the other way
    ts = graph.recvs(a.stage) if a.kind in ("RECV_F", "SEND_B") else graph.sends(a.stage)
    send = a.kind.startswith("SEND")
    for t in ts:
        if backward and not t.grad:
            continue
        kind = transfer_kind(t, spatial_stages)
        tag = p2p_tag(t, a.copy, a.mb, backward, microbatches, n)
        peer_stage = t.src if a.kind in ("RECV_F", "SEND_B") else t.dst
        if kind == "gather" and a.kind in ("RECV_F", "SEND_B"):  # one piece per tile
            assert grid is not None
            out += [Message(send, t, peer_stage, u, tag, _tile_shape(grid, t, u),
                            _rect(grid, t, u)) for u in range(grid.size)]
            continue
        if kind == "replicated" and a.kind in ("SEND_F", "RECV_B") and mine != 0:
            continue  # tile 0 sends the whole value; its gradient comes back to tile 0 only
        peer_tile = mine if kind == "tile" else 0
        tiled = t.tiled and kind in ("tile", "gather")  # a gather's tile end: its own tile
        shape = _tile_shape(grid, t, mine) if tiled and grid is not None else t.shape
        out.append(Message(send, t, peer_stage, peer_tile, tag, shape))
    return out


TagUses = dict[str, tuple[int, str]]
"""What uses tags -> (the largest tag it uses, what makes it smaller)."""


def tag_uses(plan: Plan, transfers: int, halo: dict[int, int]) -> TagUses:
    """Every kind of tag a program of ``plan`` uses: its stage transfers (``transfers`` per
    model copy), the halo exchanges of each spatial stage (``halo``: stage -> its tile
    module's largest tag) and the creation of its sub-communicators."""
    mbs = plan.gems_times * plan.microbatches
    uses: TagUses = {"point-to-point transfers between stages": (
        max_p2p_tag(plan.copies, mbs, transfers),
        f"2 directions x {plan.copies} model copies x {mbs} micro-batches per copy "
        f"(microbatches x gems_times) x {transfers} tensors crossing the stage cuts: use "
        f"fewer micro-batches, or cuts that fewer tensors cross (Plan.balance, fewer stages)")}
    for s, tag in sorted(halo.items()):
        uses[f"halo exchanges of stage {s}"] = (
            tag, "two tags per halo exchange, ring attention or join of the tile module: "
            "spread the spatial region over more stages (Plan.spatial_stages), each with fewer "
            "windowed ops")
    groups = plan.stages + (plan.data_parallel * plan.copies * plan.spatial_stages
                            if plan.spatial else 0)
    uses["communicator creation"] = (groups - 1, "one tag per stage group and tile group")
    return uses


def check_tags(uses: TagUses, bound: int = MPI_TAG_UB_MIN, where: str = "") -> None:
    """Raise PlanError when a use of ``uses`` needs a tag above ``bound``. ``where`` says what
    the bound is (default: the smallest MPI_TAG_UB the MPI standard allows)."""
    where = where or f"{MPI_TAG_UB_MIN}, the largest tag every MPI accepts (MPI_TAG_UB)"
    over = [f"{what} need tags up to {tag}: {fix}" for what, (tag, fix) in uses.items()
            if tag > bound]
    if over:
        raise PlanError(f"this program's MPI tags exceed {where}:\n  " + "\n  ".join(over))
