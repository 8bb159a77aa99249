"""Plain data every layer shares: the Plan and its rank map, typed node metadata, tile
geometry, schedules as data, stage graphs, message tags. Imports nothing else of fxpar."""
