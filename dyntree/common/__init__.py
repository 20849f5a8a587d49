"""Framework-free speculator core (torch only; never imports vllm or sglang)."""
