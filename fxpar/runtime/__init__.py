"""What runs on each rank: the action loop (loop.py), gradient and statistics synchronisation
(sync.py), meta-device materialisation, and the modules that run on tiles (spatial/)."""
