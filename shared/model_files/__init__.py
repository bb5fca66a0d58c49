"""Model files: turn a `--model` spec (an HF folder, a .gguf file or 'default') into a loadable HF folder,
converting GGUF files once into the cache. The engine loads from it, the gateway reads the tokenizer from it.
"""
