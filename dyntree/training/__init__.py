"""Training pipeline for Hydra draft heads: self-distillation data, hidden-state cache, trainer."""
