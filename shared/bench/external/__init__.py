"""Scripts run by other engines' interpreters (e.g. vLLM's venv), never imported by kvrelay itself."""
