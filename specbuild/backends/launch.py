"""What an MPI launcher (mpirun) told this process in its environment: rank and world size.

A pure read of the environment, no MPI import: the TensorRT-LLM backend needs it for leader
mode (backends/tensorrt_llm.py) and mpi/context.py for MineDraft's roles, and the backend
may not import mpi/ (imports point down the chain).
"""

from __future__ import annotations

import os


def launcher_rank_size() -> tuple[int, int]:
    """(rank, world size) announced by an MPI launcher in the environment; (0, 1) alone."""
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMIX_RANK", "PMIX_SIZE")):
        if os.environ.get(size_var):
            return int(os.environ.get(rank_var, "0")), int(os.environ[size_var])
    return 0, 1
