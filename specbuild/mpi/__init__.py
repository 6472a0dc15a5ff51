"""MPI: the launch context and world-size checks, MineDraft's two-batch scheduler, the draft rank and its wire format."""
