"""The request-level interface (submit / abort / step / stats) both engines implement: the torch engine, the TensorRT-LLM adapter, and open_engine which picks one."""
