"""``fxpar-calibrate``: measure this machine's profile for the cost model and the planner.

    fxpar-calibrate --out cpu.json                  # compute rates only (one rank)
    mpiexec -n 2 fxpar-calibrate --out cpu.json     # and the links between ranks
    fxpar-calibrate --show h100-nvlink-ib           # print a profile (a file or a shipped one)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from fxpar.perf.profile import Profile, ProfileError


def _summary(p: Profile) -> str:
    def link(name: str) -> str:
        v = getattr(p, name)
        bw = f"{1 / v.beta / 1e9:.2f} GB/s" if v.beta else "-"
        return f"  {name:16s} alpha {v.alpha * 1e6:8.2f} us   {bw}"

    return "\n".join([
        f"profile {p.name!r} ({p.device}, {p.ranks_per_node} rank(s) per node at full speed "
        f"up to {p.slots_per_node or p.ranks_per_node}, {p.cores_per_rank} thread(s) per rank)",
        f"  convolutions     {p.conv_flops / 1e9:10.2f} GFLOP/s",
        f"  depthwise convs  {(p.dwconv_flops or p.conv_flops) / 1e9:10.2f} GFLOP/s",
        f"  matrix products  {p.matmul_flops / 1e9:10.2f} GFLOP/s",
        f"  memory           {p.mem_bytes / 1e9:10.2f} GB/s",
        f"  norms            {(p.norm_bytes or p.mem_bytes) / 1e9:10.2f} GB/s",
        f"  pools            {p.pool_rate / 1e9:10.2f} G window elements/s" if p.pool_rate
        else "  pools            memory-bound",
        f"  per conv call    {p.conv_pixels:10.1f} rows of work (fixed cost)",
        f"  per op           {p.op_s * 1e6:10.2f} us",
        f"  per tile op      {p.tile_op_s * 1e6:10.2f} us (each way)",
        *(link(k) for k in ("p2p_intra", "p2p_inter", "allreduce_intra", "allreduce_inter")),
    ])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fxpar-calibrate",
        description="Measure this machine's compute rates and (under mpiexec with 2 or more "
                    "ranks) the cost of messages and allreduces, as a profile JSON for the "
                    "cost model.")
    parser.add_argument("--out", help="write the profile here (rank 0)")
    parser.add_argument("--name", default="this-machine", help="the profile's name")
    parser.add_argument("--quick", action="store_true", help="shorter timings (tests)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="ranks jobs will place on one node (default: its cores)")
    parser.add_argument("--show", metavar="PROFILE",
                        help="print a profile (a JSON file or a shipped name) and exit")
    a = parser.parse_args(argv)
    if a.show:
        try:
            p = Profile.load(a.show)
        except ProfileError as e:
            print(f"fxpar-calibrate: {e}", file=sys.stderr)
            return 2
        print(_summary(p))
        return 0
    from fxpar.comm.world import world
    from fxpar.planner.calibrate import calibrate

    comm = world()
    profile = calibrate(comm if comm.size > 1 else None, a.name, a.quick, a.ranks_per_node)
    if comm.rank == 0:
        print(_summary(profile))
        if a.out:
            profile.save(a.out)
            print(f"wrote {a.out}")
        else:
            print(json.dumps(profile.to_json(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
