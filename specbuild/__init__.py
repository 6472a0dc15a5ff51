"""specbuild: compile speculation bundles and serve them with lossless speculative decoding."""

__version__ = "0.1.0"

# Before torch loads OpenMP (libgomp), when the user has not chosen (OMP_WAIT_POLICY or
# GOMP_SPINCOUNT): how long idle threads spin before they sleep, from the cores free now
# (specbuild/model/threads.py says why and what was measured). No effect if torch was
# imported before specbuild.
from specbuild.model.threads import wait_policy as _wait_policy

_wait_policy()
