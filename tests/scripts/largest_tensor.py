"""``Largest``: a dispatch mode that records the largest tensor with storage any op makes, in elements (of a
DTensor, its local shard). The scripts that check a rank never makes a whole parameter (a joiner's meta build, a
re-sharding) import it; they run with this folder on ``sys.path``."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from phoenix_runtime.parallel import local_of


class Largest(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not local_of(t).is_meta:
                self.n = max(self.n, local_of(t).numel())
        return out
