"""Machine profiles: what the cost model (fxpar.perf.costmodel) knows about a machine.

A profile is a JSON file: compute rates of one rank (FLOP/s for convolutions and matrix
products, bytes/s for memory-bound ops, a fixed cost per op), the cost of a message as
``alpha + beta * bytes`` inside a node and between nodes, the same for an allreduce step, and
how many ranks share a node. ``fxpar-calibrate`` measures one on the machine it runs on
(fxpar.planner.calibrate); the project ships ``h100-nvlink-ib``, built from published figures
(its ``sources`` say which), for studies of machines not at hand::

    {"name": "h100-nvlink-ib", "device": "cuda", "ranks_per_node": 8, "cores_per_rank": 1,
     "conv_flops": 4.9e14, "matmul_flops": 4.9e14, "mem_bytes": 2.7e12, "op_s": 5e-6,
     "p2p_intra": [2.5e-6, 2.2e-12], "p2p_inter": [5e-6, 2.0e-11],
     "allreduce_intra": [1e-5, 2.2e-12], "allreduce_inter": [2e-5, 2.0e-11],
     "measured": {...}, "sources": [...]}
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SHIPPED = Path(__file__).resolve().parent / "profiles"
"""Profiles that come with fxpar (``Profile.load("h100-nvlink-ib")``)."""


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Link:
    """Cost of moving ``b`` bytes: ``alpha + beta * b`` seconds."""

    alpha: float
    beta: float

    def seconds(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes


@dataclass(frozen=True)
class Profile:
    """One machine, as the cost model sees it (module doc)."""

    name: str
    device: str
    conv_flops: float
    """FLOP/s one rank reaches in convolutions (multiply-add = 2 FLOPs)."""
    matmul_flops: float
    """FLOP/s in matrix products (linear layers)."""
    mem_bytes: float
    """Bytes/s one rank reads plus writes in memory-bound ops (pointwise, norms, pools)."""
    op_s: float
    """Fixed seconds per op (dispatch, kernel launch)."""
    p2p_intra: Link
    p2p_inter: Link
    allreduce_intra: Link
    """One step of a ring allreduce between ranks of one node (alpha per step, beta per byte
    sent in it)."""
    allreduce_inter: Link
    conv_grid: tuple[tuple[int, int, float], ...] = ()
    """Dense convolutions' FLOP/s by shape: ``(channels, kernel, FLOP/s)`` measured with as
    many output as input channels; a layer takes the rate of the nearest channel count (log
    scale) with its kernel (1 or larger). Empty: ``conv_flops`` for every layer."""
    dwconv_flops: float = 0.0
    """FLOP/s of grouped (depthwise) convolutions, far below dense ones on CPUs; 0:
    ``conv_flops``."""
    tile_op_s: float = 0.0
    """Fixed seconds a tile op of a spatial stage adds in each direction (a halo exchange, a
    norm's statistics: the runtime's own overhead and the wait for the group), measured by
    ``fxpar-calibrate`` with fxpar's runtime; 0: none."""
    tile_op_bytes: float = 0.0
    """Bytes/s at which a tile op's cost grows with the tile it works on (building the
    window, slicing the gradient back: ``tile_op_s + tile bytes / tile_op_bytes`` each way),
    measured by ``fxpar-calibrate`` on two tile sizes; 0: no per-byte term."""
    norm_bytes: float = 0.0
    """Bytes/s of BatchNorm / group norm in training (statistics, then the normalisation: more
    passes per byte than a pointwise op); 0: ``mem_bytes``."""
    pool_rate: float = 0.0
    """Window elements per second of a max / average pool's forward (output elements x kernel
    size): on CPUs far slower than the pool's bytes say; 0: memory-bound like a pointwise
    op."""
    conv_pixels: float = 0.0
    """Output pixels of work a convolution call costs on top of its own (its rows: batch x
    spatial positions): ``FLOPs x (pixels + conv_pixels) / pixels / rate``.
    A call's fixed cost (packing its weights, a weight gradient reduced over few rows) makes
    small calls run far below the rate on CPUs: a micro-batch of one small image, a deep
    layer's 4x4 map, a small tile. Measured by ``fxpar-calibrate`` from one 3x3 convolution's
    forward and backward on two sizes (64 and 1,024 rows); 0: none."""
    ranks_per_node: int = 1
    """Ranks placed on one node (rank r sits on node r // ranks_per_node)."""
    cores_per_rank: int = 1
    slots_per_node: int = 0
    """Ranks a node runs at full speed (its cores / cores_per_rank, or its GPUs); more ranks
    on a node share them and compute proportionally slower (0: ranks_per_node)."""
    measured: dict[str, Any] = field(default_factory=dict)
    """What the calibration saw (raw timings), for the record."""
    sources: tuple[str, ...] = ()
    """Where published figures came from (shipped profiles)."""
    notes: str = ""
    """What was assumed rather than measured or published."""

    def conv_rate(self, channels: int, kernel: int) -> float:
        """FLOP/s of a dense convolution with ``channels`` input channels (per group) and a
        ``kernel``-wide window (:attr:`conv_grid`, else ``conv_flops``)."""
        if not self.conv_grid:
            return self.conv_flops
        import math

        wide = kernel > 1
        same = [g for g in self.conv_grid if (g[1] > 1) == wide] or list(self.conv_grid)
        return min(same, key=lambda g: abs(math.log(g[0]) - math.log(max(channels, 1))))[2]

    def tile_op(self, nbytes: float) -> float:
        """Seconds of one tile op, one direction, on a tile of ``nbytes``."""
        return self.tile_op_s + (nbytes / self.tile_op_bytes if self.tile_op_bytes else 0.0)

    def slowdown(self, world_size: int) -> float:
        """How much slower each rank computes when ``world_size`` ranks are placed
        (oversubscribed nodes share their slots)."""
        on_node = min(world_size, self.ranks_per_node)
        return max(1.0, on_node / (self.slots_per_node or self.ranks_per_node))

    def link(self, a: int, b: int, collective: bool = False) -> Link:
        """The link between ranks ``a`` and ``b`` (same node: ``rank // ranks_per_node``)."""
        same = a // self.ranks_per_node == b // self.ranks_per_node
        if collective:
            return self.allreduce_intra if same else self.allreduce_inter
        return self.p2p_intra if same else self.p2p_inter

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for k in ("p2p_intra", "p2p_inter", "allreduce_intra", "allreduce_inter"):
            out[k] = [out[k]["alpha"], out[k]["beta"]]
        out["sources"] = list(self.sources)
        out["conv_grid"] = [list(g) for g in self.conv_grid]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "profile") -> Profile:
        links = ("p2p_intra", "p2p_inter", "allreduce_intra", "allreduce_inter")
        rates = ("conv_flops", "matmul_flops", "mem_bytes", "op_s")
        missing = [k for k in ("name", "device", *rates, *links) if k not in data]
        if missing:
            raise ProfileError(f"{where}: missing {', '.join(missing)} (fxpar-calibrate writes "
                               f"a complete profile)")
        kw = dict(data)
        for k in links:
            v = kw[k]
            if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(
                    isinstance(u, (int, float)) and u >= 0 for u in v)):
                raise ProfileError(f"{where}: {k} must be [alpha seconds, beta seconds per "
                                   f"byte], both >= 0, got {v!r}")
            kw[k] = Link(float(v[0]), float(v[1]))
        optional = ("norm_bytes", "tile_op_s", "dwconv_flops", "pool_rate", "tile_op_bytes",
                    "conv_pixels")
        for k in (*rates, *(f for f in optional if f in kw)):
            v = kw[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or \
                    (v == 0 and k not in ("op_s", *optional)):
                raise ProfileError(f"{where}: {k} must be a positive number, got {v!r}")
        kw["sources"] = tuple(kw.get("sources", ()))
        kw["conv_grid"] = tuple((int(c), int(k), float(r)) for c, k, r in kw.get("conv_grid", ()))
        known = set(cls.__dataclass_fields__)
        extra = sorted(set(kw) - known)
        if extra:
            raise ProfileError(f"{where}: unknown fields {extra}")
        return cls(**kw)

    def save(self, path: Path | str) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, name_or_path: str | Path) -> Profile:
        """A profile file, or a shipped profile by name (``h100-nvlink-ib``)."""
        path = Path(name_or_path)
        if not path.exists():
            shipped = SHIPPED / f"{name_or_path}.json"
            if not shipped.exists():
                names = sorted(p.stem for p in SHIPPED.glob("*.json"))
                raise ProfileError(f"no profile file {str(name_or_path)!r} and no shipped "
                                   f"profile of that name (shipped: {', '.join(names)}); "
                                   f"fxpar-calibrate --out FILE measures this machine")
            path = shipped
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ProfileError(f"{path}: not JSON ({e})") from None
        return cls.from_json(data, str(path))
