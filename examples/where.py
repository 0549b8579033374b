"""Where each rank runs: check a host list before training on it.

Every rank prints its rank, local_rank (its index on its host), cross_rank (its host's index) and
hostname, then the ranks allreduce their rank numbers (0 + 1 + ... + size-1 when every link works).

    horovodrun -np 4 -H node1:2,node2:2 --gloo --network-interface eth0 python examples/where.py
    mpirun -np 4 -H node1:2,node2:2 --mca btl_tcp_if_include eth0 python examples/where.py
"""
import socket

import horovod.torch as hvd
import torch

hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="where.sum").item()
print(f"rank {hvd.rank()}/{hvd.size()} local_rank {hvd.local_rank()}/{hvd.local_size()} "
      f"cross_rank {hvd.cross_rank()}/{hvd.cross_size()} on {socket.gethostname()}: "
      f"allreduce of the ranks = {total:g} (expected {hvd.size() * (hvd.size() - 1) // 2})", flush=True)
