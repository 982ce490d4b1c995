"""Interoperability: Hugging Face Qwen3 checkpoints (hf, safetensors_io, the PyTorch templates in hf_remote/)
and loading a model for inference from a run or an export."""
