"""specbuild: compile speculation bundles and serve them with lossless speculative decoding."""

import os as _os

__version__ = "0.1.0"

# Before torch loads OpenMP (libgomp), when the user has not chosen: spin only briefly
# before sleeping. Measured on a 2-core box, SmolLM2-135M float32 decode step, 2 threads:
# libgomp's default 29 ms quiet but 1190 ms beside two busy processes;
# OMP_WAIT_POLICY=PASSIVE 43 / 78 ms; GOMP_SPINCOUNT=10000 30 / 61 ms. (No effect if torch
# was imported before specbuild.)
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = "10000"
