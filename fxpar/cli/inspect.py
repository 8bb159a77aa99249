"""``fxpar-inspect``: print what fxpar sees in a model.

    fxpar-inspect torchvision:resnet50 --image-size 1024 --batch-size 2
    fxpar-inspect models:amoebanet -k num_layers=6 -k num_filters=64 --image-size 512
    fxpar-inspect path/to/net.py:make_net --image-size 2048 --channels 1
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

from fxpar.plan import PlanError
from fxpar.report import node_table, totals_line
from fxpar.trace import TraceError, trace
from fxpar.zoo import ModelSpecError, build_model, parse_kwargs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fxpar-inspect", description="Trace a model on fake tensors (no image memory) and "
        "print its graph: every node's op, output shape, FLOPs and bytes.")
    p.add_argument("model", help="torchvision:NAME, models:NAME or path/to/file.py:FACTORY")
    p.add_argument("-k", "--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the model factory (repeatable)")
    p.add_argument("--image-size", type=int, required=True, help="input height and width")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--channels", type=int, default=3, help="input channels (default 3)")
    p.add_argument("--num-classes", type=int, default=None,
                   help="passed to the factory as num_classes")
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"),
                   default="float32")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        kwargs = parse_kwargs(args.model_arg)
        if args.num_classes is not None:
            kwargs["num_classes"] = args.num_classes
        model = build_model(args.model, meta=True, **kwargs)  # no parameter memory
        dtype = getattr(torch, args.dtype)
        model = model.to(dtype)
        shape = (args.batch_size, args.channels, args.image_size, args.image_size)
        start = time.perf_counter()
        gm = trace(model, torch.empty(shape, dtype=dtype, device="meta"))
        took = time.perf_counter() - start
    except (ModelSpecError, TraceError, PlanError, ValueError, TypeError) as e:
        print(f"fxpar-inspect: error: {e}", file=sys.stderr)
        return 2
    print(f"model: {args.model}  input: {'x'.join(map(str, shape))} {args.dtype}  "
          f"nodes: {len(gm.graph.nodes)}  (traced and analysed in {took:.2f} s)")
    print(node_table(gm))
    print(totals_line(gm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
