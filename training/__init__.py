"""Training in torch (the `train` extra): the demo model and Edge0's prerouter heads and recovery LoRA."""
