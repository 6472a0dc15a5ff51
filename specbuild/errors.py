"""User-facing error types.

Two tiers (DESIGN.md): `assert` for internal invariants; these typed errors for anything
a user supplied (flags, checkpoints, bundles, request bodies). Each message names the
offending value and the limit it broke. The CLI prints them on one line without a
traceback and exits non-zero; the server answers 4xx with a JSON body.
"""


class SpecbuildError(Exception):
    """Base class: a problem with something the user gave us."""

    exit_code = 2


class CheckpointError(SpecbuildError):
    """A checkpoint that is missing, corrupt or of an unsupported architecture."""


class BundleError(SpecbuildError):
    """A bundle directory that cannot be loaded (schema, fingerprint, limits)."""


class RequestError(SpecbuildError, ValueError):
    """A request whose values are out of range (prompt too long, bad sampling values)."""


class NumericsError(SpecbuildError, ArithmeticError):
    """Non-finite numbers (NaN, +inf, or a row with no finite entry) where a request's
    logits or probabilities must be finite. The sampler and the acceptance rules raise it
    for one sequence; the engine fails that request alone (a server-side fault: 5xx)."""
