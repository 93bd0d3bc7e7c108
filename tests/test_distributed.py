"""eyas.distributed.resolve_device: the device each rank computes on."""

import torch

from eyas.distributed import resolve_device


def test_a_bare_cuda_means_this_ranks_gpu():
    # torch.cuda.set_device refuses torch.device("cuda") (no index): `--extract.device=cuda` must name a GPU
    assert resolve_device("cuda", 3, True) == torch.device("cuda", 3)
    assert resolve_device("cuda:1", 3, True) == torch.device("cuda", 1)  # an index given is kept
    assert resolve_device("cpu", 3, True) == torch.device("cpu")
    assert resolve_device("", 2, True) == torch.device("cuda", 2)
    assert resolve_device("", 2, False) == torch.device("cpu")
