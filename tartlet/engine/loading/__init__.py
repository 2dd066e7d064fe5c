"""Loading weights: GGUF and Hugging Face loaders, quantized formats, the model store, memory backing."""
