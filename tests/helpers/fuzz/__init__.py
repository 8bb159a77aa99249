"""Fuzzed transparency: random small CNNs and random valid plans (tests/mpi/test_fuzz.py)."""
