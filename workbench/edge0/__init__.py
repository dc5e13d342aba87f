"""Edge0 ("The Other Half of the Memory Wall") on the workbench.

    artifacts.py        numpy: safetensors files beside the model, model identity, weights from a pack
    serve.py            numpy: the prerouter (predictor + router hook), unmerged LoRA deltas, counters
    ladder.py           numpy: `python -m workbench ladder edge0` (quality rungs, recall, speed A/B)
    train_common.py     torch (the `train` extra): the student/teacher path in torch, heads, adapters
    train_prerouter.py  torch: collect teacher data on the training corpora, train the heads
    train_lora.py       torch: train the recovery LoRA on the student path (CE, then on-policy reverse KL)

Serving never imports torch.
"""
