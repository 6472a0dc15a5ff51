"""Foreign formats in and out, no runtime: Hugging Face directories, GGUF (+ its tokenizer), TensorRT-LLM checkpoints. Imports only bundle and errors."""
