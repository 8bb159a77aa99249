"""Fuzzed transparency: random small CNNs and random valid plans (tests/test_fuzz.py)."""
