"""The CPU fast paths of weight sync: the "shm" transport (shm.py) and its shared file (shm_file.py), and
the in-place loads on a vLLM worker (engine_ops.py: reload, direct load, zero copy)."""
