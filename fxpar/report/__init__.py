"""Pictures of a compiled program for people: stage graphs, tile grids and schedules
(draw.py; ``fxpar-inspect --draw``)."""
