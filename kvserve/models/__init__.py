"""Model definitions (Llama, Qwen2), the weight loader (GGUF, safetensors) and the named-model catalog."""
