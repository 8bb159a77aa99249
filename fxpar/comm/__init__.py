"""Communication: Comm over mpi4py (mpi.py) or torch.distributed (torch_dist.py), the world
communicator (world.py), GPU binding (device.py), fail-fast and the watchdog (failfast.py)."""
