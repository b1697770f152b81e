import os

import torch

# Ranks and tests share 2 cores: one thread each keeps results deterministic and fast.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")
