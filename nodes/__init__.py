"""Thin ComfyUI adapters onto ``training/``: one module per concern."""
