"""The compiler's front half: capture through torch.export (capture.py), analysis on fake tensors
(trace.py) and the layout rules of each ATen op family (rules/)."""
