"""``fxpar-predict``: run a trained model over a whole image, region by region, exactly.

    mpiexec -n 4 fxpar-predict models:unet slide.svs mask.tif --weights unet.pt \\
        --num-classes 2 --spatial-parts 4 --region 2048 --output argmax
    fxpar-predict smp.py:make scene.tif probs.zarr --checkpoint ckpt/ --level 1 --output softmax

The image is any format fxpar.data.images reads (pyramidal TIFF, SVS, NDPI, OME-TIFF, GeoTIFF,
Zarr, .npy, PNG), at pyramid ``--level``; each rank reads only its tile of each crop plus the
halo. The output (a ``.zarr`` array, or a tiled ``.tif``; GeoTIFF tags are carried over) is
written region by region; run the same command again after an interruption and it continues
where it stopped. The result equals the model run on the whole image in one process (see
fxpar.compiler.predict and fxpar.compiler.receptive). Every user error is reported before any
rank talks to another, as ``fxpar-predict: error: ...`` with exit code 2.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fxpar.cli.args import grid_arg, user_error
from fxpar.comm import failfast
from fxpar.comm.device import bind
from fxpar.comm.mpi import Comm
from fxpar.compiler.driver import predict
from fxpar.compiler.predict import OUTPUTS
from fxpar.compiler.receptive import ReachError
from fxpar.core.plan import SLICES, Plan, PlanError
from fxpar.data.errors import DataError
from fxpar.frontend.trace import TraceError
from fxpar.models.zoo import ModelSpecError, build_model, parse_kwargs
from fxpar.program.checkpoint import CheckpointError

USER_ERRORS = (PlanError, ModelSpecError, TraceError, DataError, CheckpointError, ReachError,
               ValueError, TypeError)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fxpar-predict", description="Run a trained model over "
                                "a whole image region by region (run under mpiexec -n "
                                "WORLD_SIZE); the output equals one process on the whole "
                                "image.")
    p.add_argument("model", help="torchvision:NAME, models:NAME or path/to/file.py:FACTORY")
    p.add_argument("image", type=Path, help="the image: TIFF / SVS / NDPI / OME-TIFF / "
                   "GeoTIFF, .zarr, .npy or PNG / JPEG")
    p.add_argument("out", type=Path, help="where to write: OUT.zarr or OUT.tif (tiled)")
    p.add_argument("-k", "--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the model factory (repeatable)")
    p.add_argument("--num-classes", type=int, default=None,
                   help="passed to the model factory as num_classes")
    w = p.add_mutually_exclusive_group()
    w.add_argument("--weights", type=Path, metavar="FILE.pt",
                   help="a single-device state_dict (torch.save(model.state_dict(), FILE))")
    w.add_argument("--checkpoint", type=Path, metavar="DIR",
                   help="an fxpar checkpoint folder (fxpar-run --checkpoint)")
    p.add_argument("--level", type=int, default=0, help="pyramid level of the image (0: full "
                   "resolution)")
    p.add_argument("--region", type=int, default=1024, metavar="N",
                   help="input pixels per region and side (rounded up to the model's stride); "
                   "each region is computed on a crop that adds the model's margins")
    p.add_argument("--batch", type=int, default=1, metavar="B",
                   help="regions per forward (data-parallel replicas split them)")
    p.add_argument("--output", choices=OUTPUTS, default="argmax",
                   help="class indices (default), probabilities, or raw logits")
    p.add_argument("--output-key", metavar="KEY", default=None,
                   help="for a model that returns several tensors (a dict, tuple, dataclass): "
                   "the one to write, by key or path (out, ['out'], [0], .mask)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where each rank computes: cuda binds rank r of a node to GPU r %% GPUs "
                   "(fxpar.comm.device); auto: cuda when available (default)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output "
                   "instead of resuming it")
    p.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("plan (every rank computes part of each region)")
    g.add_argument("--spatial-parts", "--num-spatial-parts", type=int, default=1)
    g.add_argument("--slice", "--slice-method", choices=SLICES, default="square")
    g.add_argument("--grid", type=grid_arg, metavar="HxW|DxHxW")
    g.add_argument("--stages", "--split-size", type=int, default=1)
    g.add_argument("--spatial-stages", "--spatial-size", type=int, default=1)
    g.add_argument("--data-parallel", "--local-DP", type=int, default=1)
    g.add_argument("--halo-fusion", choices=("off", "auto", "all"), default="off")
    return p


def _weights(a: argparse.Namespace) -> dict[str, torch.Tensor] | None:
    if a.checkpoint is not None:
        from fxpar.program.checkpoint import export

        return export(a.checkpoint)
    if a.weights is None:
        return None
    if not a.weights.is_file():
        raise DataError(f"--weights {a.weights}: no such file")
    state = torch.load(a.weights, map_location="cpu", weights_only=True)
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict):
        raise DataError(f"--weights {a.weights} holds a {type(state).__name__}, not a "
                        f"state_dict: save torch.save(model.state_dict(), FILE)")
    return state


def _digest(state: dict[str, torch.Tensor] | None) -> str:
    if state is None:
        return "initial"
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(str(float(state[k].double().sum())).encode())
    return h.hexdigest()[:16]


def _open(a: argparse.Namespace) -> Any:
    from fxpar.data.images import open_image

    return open_image(a.image, a.level)


def setup(a: argparse.Namespace) -> tuple[torch.nn.Module, Plan, Any, dict[str, Any]]:
    """The model with its weights, the plan and the image; raises a user error."""
    if a.region < 1 or a.batch < 1:
        raise ValueError("--region and --batch must be at least 1")
    if a.out.suffix.lower() not in (".zarr", ".tif", ".tiff"):
        raise DataError(f"{a.out}: write a .zarr array or a .tif / .tiff image")
    plan = Plan(spatial_parts=a.spatial_parts if a.grid is None else 1, slice=a.slice,
                grid=a.grid, stages=a.stages, spatial_stages=a.spatial_stages,
                data_parallel=a.data_parallel, halo_fusion=a.halo_fusion)
    if a.batch % plan.data_parallel:
        raise PlanError(f"--batch {a.batch} regions cannot be split over --data-parallel "
                        f"{plan.data_parallel} replicas: give a multiple of it")
    image = _open(a)
    kwargs = parse_kwargs(a.model_arg)
    if a.num_classes is not None:
        kwargs.setdefault("num_classes", a.num_classes)
    model = build_model(a.model, **kwargs)
    state = _weights(a)
    if state is not None:
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            raise DataError(f"the weights do not fit {a.model}: {str(e).splitlines()[0]} "
                            f"(check the model arguments, e.g. --num-classes)") from None
    settings = {"model": a.model, "model_args": sorted(a.model_arg),
                "weights": _digest(state), "level": a.level, "path": str(a.image),
                "output_key": a.output_key}
    return model, plan, image, settings


def main(argv: Sequence[str] | None = None, comm: Comm | None = None) -> int:
    a = parser().parse_args(argv)
    held = failfast.install()
    try:
        code = _main(a, comm)
    finally:
        failfast.uninstall(held)
    return code


def _world(comm: Comm | None) -> Comm | None:
    if comm is None and failfast.launched():
        from fxpar.comm.world import world

        return world()
    return comm


def _main(a: argparse.Namespace, comm: Comm | None) -> int:
    world = _world(comm)
    rank = world.rank if world is not None else 0
    t0 = time.perf_counter()
    try:
        model, plan, image, settings = setup(a)
        if world is not None and world.size != plan.world_size:
            raise PlanError(f"this plan needs {plan.world_size} ranks but the job has "
                            f"{world.size}: run with `mpiexec -n {plan.world_size}`")
        if world is not None and world.size > 1:
            failfast.agree(world, None)
        dtype = getattr(torch, a.dtype)
        where = bind(world if a.device != "cpu" else None, a.device)
        say = (lambda s: print(s, flush=True)) if rank == 0 else None
        if say is not None:
            shape = "x".join(map(str, image.shape))
            say(f"fxpar-predict: {a.model} on {a.image} (level {a.level}, {shape}) with "
                f"{plan.world_size} rank(s)")
        result = predict(model, plan, image, a.out, region=a.region, batch=a.batch,
                         output=a.output, output_key=a.output_key, dtype=dtype, comm=world,
                         overwrite=a.overwrite,
                         progress=not a.no_progress, settings=settings, geo=_geo(image),
                         log=lambda s: print(s, flush=True), device=where)
    except (*USER_ERRORS, failfast.Disagreement) as e:
        # every error that reaches here is the same on every rank (set-up errors are agreed
        # on; predict's own checks run before its first message), so none ends the job hard
        return user_error("fxpar-predict", e, world, checked=False)
    if result.output is not None:
        mpx = result.grid.image[-1] * result.grid.image[-2] / 1e6
        done = result.regions - result.skipped
        rate = mpx * done / max(result.regions, 1) / result.seconds if result.seconds else 0.0
        print(f"wrote {result.output}: {done} region(s) in {result.seconds:.1f} s "
              f"({rate:.2f} Mpx/s; {result.skipped} resumed), crops computed "
              f"{result.overlap:.2f}x the image; total {time.perf_counter() - t0:.1f} s",
              flush=True)
    return 0


def _geo(image: Any) -> dict[str, Any] | None:
    """The reader's GeoTIFF tags for the grid of its level (they describe level 0)."""
    geo = getattr(image, "geo", None)
    if not geo or image.level == 0:
        return geo
    from fractions import Fraction

    from fxpar.data.images import geo_scaled

    return geo_scaled(geo, tuple(Fraction(b, a) for a, b in zip(
        image.levels[0][-2:], image.size[-2:], strict=True)))



if __name__ == "__main__":
    sys.exit(main())
