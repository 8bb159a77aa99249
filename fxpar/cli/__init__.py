"""The command-line tools: fxpar-inspect, fxpar-run, fxpar-checkpoint."""
