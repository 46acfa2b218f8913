"""The policy model: a Llama/Qwen2/Qwen3-family decoder (transformer.py), Hugging Face checkpoints
in and out (hf.py, tokenizer.py), the shipped architectures, and the sharding rules (sharding.py).
"""
