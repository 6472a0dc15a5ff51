"""The compile step: checkpoints in, bundle out. May use runtime.model (training);
the runtime never imports this package."""
