"""SGLang adapter (filled by the engine-plugin issue)."""
