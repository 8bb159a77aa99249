"""Modules that run on tiles and talk within their tile group: halo exchange and join (ops.py,
haloconv.py), synchronised batch / group norm, reductions over the image, interpolation."""
