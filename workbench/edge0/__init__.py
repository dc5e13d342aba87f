"""Edge0 ("The Other Half of the Memory Wall") on the workbench: the serving side.

    artifacts.py        numpy: safetensors files beside the model, model identity, weights from a pack
    serve.py            numpy: the prerouter (predictor + router hook), unmerged LoRA deltas, counters

Its ladder is experiments/edge0_ladder.py; training (torch) is training/edge0_*.py. Serving never imports torch.
"""
