"""Layout rules: what each ATen op family needs when its input is tiled (nothing, a halo, an
allreduce of partial sums, or the end of the tiled region)."""
