"""Training checkpoints: capture and restore, recover slots, staged uploads, the manager."""
