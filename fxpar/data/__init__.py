"""Data in and out: image and volume readers (images.py, image_formats.py, volumes.py), sample
folders and the per-rank loader that reads only a rank's input window (samples.py, data.py),
and the region plan and writers of whole-slide prediction (regions.py, writers.py)."""
