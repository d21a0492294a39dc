"""The host-independent training core: torch and safetensors only, never ComfyUI."""
