"""Entry points named as vLLM names them, so vLLM command lines carry over."""
