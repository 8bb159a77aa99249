"""Region-by-region inference under mpiexec (run by tests/mpi/test_predict.py, 4 ranks): the output
of ``fxpar.predict`` equals the model run on the whole image in one process, in float64, for
images 8 or more times a region, under SP4 (square and vertical tiles), SP2 + DP2 (regions
split over replicas), SP2 + LP2 (the output on the last stage's rank) and on a
segmentation-models-pytorch U-Net; every rank reads only its window of each crop; the CLI writes
a Zarr and a GeoTIFF that equal it too; an interrupted run resumes."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from helpers.transparency import sub_comm
from torch import nn

import fxpar
from fxpar.comm.world import world
from fxpar.compiler.driver import predict
from fxpar.compiler.predict import ArrayImage
from fxpar.core.geometry import Rect

ATOL = 1e-11


def small_unet(num_classes: int = 3, channels: int = 3) -> nn.Module:
    """Encoder (3x3 convolutions, BatchNorm, max pool, a strided convolution), decoder
    (transposed convolution, nearest upsampling), skip connections: step 4."""
    torch.manual_seed(1)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Sequential(nn.Conv2d(channels, 6, 3, padding=1), nn.BatchNorm2d(6),
                                   nn.ReLU())
            self.b = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(6, 8, 3, padding=1), nn.ReLU())
            self.c = nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
                                   nn.ConvTranspose2d(8, 8, 2, stride=2))
            self.up = nn.Upsample(scale_factor=2, mode="nearest")
            self.head = nn.Conv2d(6 + 8, num_classes, 3, padding=1)

        def forward(self, x):
            a = self.a(x)
            b = self.b(a)
            c = self.c(b) + b
            return self.head(torch.cat([a, self.up(c)], 1))

    net = Net().double()
    with torch.no_grad():  # running statistics that are not the defaults
        net.train()(torch.randn(2, channels, 32, 32, dtype=torch.float64))
    return net.eval()


def odd_net(num_classes: int = 2) -> nn.Module:
    """Any size in, odd sizes included: max pool with padding, a dilated convolution, average
    pooling without the padding in its count, a transposed convolution back up."""
    torch.manual_seed(2)
    net = nn.Sequential(
        nn.Conv2d(3, 5, 3, padding=1), nn.BatchNorm2d(5), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(5, 6, 3, padding=2, dilation=2), nn.ReLU(),
        nn.AvgPool2d(3, 1, 1, count_include_pad=False),
        nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(4, num_classes, 1)).double()
    with torch.no_grad():
        net.train()(torch.randn(2, 3, 32, 32, dtype=torch.float64))
    return net.eval()


class SqueezeExcite(nn.Module):
    """A global mean inside: not local (tests/mpi/test_predict.py,
    tests/helpers/errors_catalogue.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y * torch.sigmoid(y.mean((2, 3), keepdim=True))


class AlignCorners(nn.Module):
    """Bilinear upsampling with align_corners=True: its ratio depends on the size."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        y = F.max_pool2d(self.conv(x), 2)
        return F.interpolate(y, scale_factor=2, mode="bilinear", align_corners=True)


def _image(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def _reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(x[None])[0]


def _run(n: int, plan: fxpar.Plan, model: nn.Module, x: torch.Tensor, region: int,
         batch: int = 1, shapes: int | None = None) -> None:
    comm = sub_comm(n)
    if comm is None:
        return
    image = ArrayImage(x)
    got = predict(model, plan, image, None, region=region, batch=batch, dtype=torch.float64,
                  comm=comm, progress=False)
    assert got.regions >= 8, got.regions
    if shapes is not None:
        assert len(got.shapes) == shapes, got.shapes
    writer = got.output is not None
    assert sum(comm.allgather_object(writer)) == 1
    if writer:
        ref = _reference(model, x)
        out = torch.from_numpy(got.output)
        assert out.shape == ref.shape, (out.shape, ref.shape)
        err = (out - ref).abs().max().item()
        assert err < ATOL, f"max abs difference {err:g} to the whole image"
    # every read lies inside a crop and is this rank's tile of it (never the whole crop, when
    # the plan splits the first stage)
    crops = [r.crop for r in got.grid.regions()]
    for read in image.reads:
        assert any(read.intersect(c) == read for c in crops), read
    if plan.spatial_parts > 1 and image.reads:
        biggest = max(r.size for r in image.reads)
        assert biggest < max(c.size for c in crops), (biggest, crops[0])
    comm.free()


def case_sp4_square_unet_equals_whole_image():
    x = _image((3, 72, 136))
    _run(4, fxpar.Plan(spatial_parts=4), small_unet(), x, region=24, shapes=1)


def case_sp4_odd_image_border_crops_equal_whole_image():
    x = _image((3, 71, 133))  # odd sizes: border crops of other shapes (4 programs)
    _run(4, fxpar.Plan(spatial_parts=4), odd_net(), x, region=24, shapes=4)


def case_sp4_vertical_batch2_equals_whole_image():
    x = _image((3, 64, 128), seed=1)
    _run(4, fxpar.Plan(spatial_parts=4, slice="vertical"), small_unet(), x, region=16,
         batch=2, shapes=1)


def case_sp2_dp2_regions_split_over_replicas():
    x = _image((3, 60, 96), seed=2)
    _run(4, fxpar.Plan(spatial_parts=2, data_parallel=2), small_unet(), x, region=20,
         batch=2)


def case_sp2_lp2_output_on_the_last_stage():
    x = _image((3, 48, 96), seed=3)
    _run(3, fxpar.Plan(spatial_parts=2, stages=2), small_unet(), x, region=16)


def case_smp_unet_sp4_equals_whole_image():
    import segmentation_models_pytorch as smp

    torch.manual_seed(0)
    model = smp.Unet("resnet18", encoder_weights=None, encoder_depth=3,
                     decoder_channels=(32, 16, 8), classes=2).double().eval()
    x = _image((3, 256, 72), seed=4)
    _run(4, fxpar.Plan(spatial_parts=4), model, x, region=32)


def _tmp(comm) -> Path:
    name = tempfile.mkdtemp(prefix="fxpar-predict-") if comm.rank == 0 else None
    return Path(comm.bcast_object(name))


def case_cli_writes_zarr_and_geotiff_equal_to_whole_image():
    import tifffile
    import zarr

    from fxpar.cli.predict import main

    comm = world()
    folder = _tmp(comm)
    model = small_unet(num_classes=3)
    x = torch.rand((3, 72, 104), generator=torch.Generator().manual_seed(5))
    pixels = (x * 255).round().to(torch.uint8)
    if comm.rank == 0:
        torch.save(model.state_dict(), folder / "w.pt")
        geo = [(33550, "d", 3, (0.5, 0.5, 0.0), True),
               (33922, "d", 6, (0.0, 0.0, 0.0, 500000.0, 4100000.0, 0.0), True),
               (34735, "H", 8, (1, 1, 0, 1, 1024, 0, 1, 1), True)]
        tifffile.imwrite(folder / "scene.tif", pixels.permute(1, 2, 0).numpy(),
                         tile=(32, 32), photometric="rgb", extratags=geo)
    comm.barrier()
    args = [f"{Path(__file__)}:small_unet", str(folder / "scene.tif"), "", "--weights",
            str(folder / "w.pt"), "--region", "16", "--spatial-parts", "4", "--output",
            "logits", "--dtype", "float64", "--no-progress"]
    for out in ("out.zarr", "out.tif"):
        args[2] = str(folder / out)
        assert main(args, comm=comm) == 0
    if comm.rank == 0:
        ref = _reference(small_unet(num_classes=3), pixels.double() / 255)
        got = torch.from_numpy(np.asarray(zarr.open_array(str(folder / "out.zarr"))[:]))
        assert (got - ref).abs().max().item() < ATOL
        with tifffile.TiffFile(folder / "out.tif") as tif:
            page = tif.pages[0]
            assert page.is_tiled
            assert tuple(page.tags[33550].value) == (0.5, 0.5, 0.0)
            assert tuple(page.tags[34735].value)[:4] == (1, 1, 0, 1)
            t = torch.from_numpy(tif.asarray())
        assert (t - ref).abs().max().item() < ATOL
    comm.barrier()


def case_rank_windows_are_tiles_of_each_crop():
    """Under SP4 each rank reads exactly its program's input window of every crop."""
    comm = world()
    x = _image((3, 64, 64), seed=6)
    image = ArrayImage(x)
    plan = fxpar.Plan(spatial_parts=4)
    got = predict(small_unet(), plan, image, None, region=16, dtype=torch.float64, comm=comm,
                  progress=False)
    want = []
    program = fxpar.compile(small_unet(), plan, torch.empty((1, 3, *got.shapes[0]),
                                                             dtype=torch.float64))
    window = program.input_windows[comm.rank]
    assert window is not None
    for r in got.grid.regions():
        want.append(window.moved(tuple(-a for a, _ in r.crop.dims)))
    assert sorted(image.reads, key=str) == sorted(want, key=str)
    whole = Rect.whole((64, 64))
    assert sum(r.size for r in image.reads) < 0.6 * sum(r.crop.size for r in got.grid.regions())
    assert all(r.intersect(whole) == r for r in image.reads)


def case_ranks_read_only_the_tiff_tiles_of_their_windows():
    """A tiled TIFF read with byte counting: each rank reads at most the stored bytes of the
    tiles its windows touch (plus the header), a fraction of what the crops hold, and the
    result equals the whole image."""
    import tifffile

    from fxpar.data.images import open_image

    comm = world()
    folder = _tmp(comm)
    x = torch.rand((3, 96, 128), generator=torch.Generator().manual_seed(7))
    pixels = (x * 255).round().to(torch.uint8)
    path = folder / "tiles.tif"
    if comm.rank == 0:
        tifffile.imwrite(path, pixels.permute(1, 2, 0).numpy(), tile=(16, 16),
                         photometric="rgb", compression="zlib")
    comm.barrier()
    with tifffile.TiffFile(path) as tif:
        page = tif.pages[0]
        stored, nx = page.databytecounts, -(-page.imagewidth // page.tilewidth)
    model = small_unet()
    with open_image(path, counting=True) as image:
        got = predict(model, fxpar.Plan(spatial_parts=4), image, None, region=32,
                      dtype=torch.float64, comm=comm, progress=False)
        bound = 0
        for w in image.stats.windows:
            (y0, y1), (x0, x1) = w.dims
            bound += sum(stored[ty * nx + tx] for ty in range(y0 // 16, (y1 - 1) // 16 + 1)
                         for tx in range(x0 // 16, (x1 - 1) // 16 + 1))
        read = image.stats.bytes - image.stats.header
        assert 0 < read <= bound + 4096, (read, bound)
        crops = sum(r.crop.size for r in got.grid.regions())
        assert sum(w.size for w in image.stats.windows) < 0.6 * crops
    if got.output is not None:
        ref = _reference(model, pixels.double() / 255)
        assert (torch.from_numpy(got.output) - ref).abs().max().item() < ATOL
    comm.barrier()


def case_rank_program_predicts_with_the_trained_weights_of_every_stage():
    """rp.predict after training SP2 + LP2 (3 ranks): each rank held only its stage's
    trained weights; the prediction equals the trained model (gathered) on the whole image."""
    import torch.nn.functional as F

    comm = sub_comm(3)
    if comm is None:
        return
    model = small_unet()
    plan = fxpar.Plan(stages=2, spatial_parts=2)
    x = _image((4, 3, 32, 32), seed=10)
    y = torch.randint(0, 3, (4, 32, 32), generator=torch.Generator().manual_seed(11))
    program = fxpar.compile(model.train(), plan, x, loss_fn=F.cross_entropy,
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    rp = program.local(comm)
    window = rp.input_window()
    for _ in range(2):
        rp.train_step(x if window is not None else None, y if rp.needs_targets else None)
    trained = rp.full_state_dict()
    image = _image((3, 48, 80), seed=12)
    got = rp.predict(image, None, region=16, dtype=torch.float64, progress=False)
    if comm.rank == 0:
        ref_model = small_unet()
        ref_model.load_state_dict(trained)
        ref = _reference(ref_model, image)
        changed = (ref - _reference(small_unet(), image)).abs().max().item()
        assert changed > 1e-3, changed  # training moved the weights
    ref = comm.bcast_object(ref if comm.rank == 0 else None)
    trained = comm.bcast_object(trained)
    for name, value in model.state_dict().items():  # every rank's model is the trained one
        assert torch.equal(value, trained[name]), name
    if got.output is not None:
        err = (torch.from_numpy(got.output) - ref).abs().max().item()
        assert err < ATOL, err
    rp.close()
    comm.free()
