"""The request-level interface (submit / abort / step / stats) both engines implement: the TensorRT-LLM adapter, and open_engine which picks it or the torch engine (engine.engine.Engine)."""
