# OpenCompass 0.5.4 config: its own ARC-Easy, ARC-Challenge and PIQA configs (the *_ppl ones: multiple choice by
# likelihood) on the models `python -m workbench serve` exposes. The data comes from $COMPASS_DATA_CACHE, made from
# the local copies by `python -m evals.opencompass.local_data` (nothing is downloaded). Settings from the
# environment, as in eval_workbench.py (its models): WORKBENCH_SERVERS (NAME=URL, comma list), WORKBENCH_LIMIT
# (the first N items).
from mmengine.config import read_base

with read_base():
    from .eval_workbench import models  # noqa: F401  (the served models, from WORKBENCH_SERVERS)
    from opencompass.configs.datasets.ARC_c.ARC_c_ppl import ARC_c_datasets
    from opencompass.configs.datasets.ARC_e.ARC_e_ppl import ARC_e_datasets
    from opencompass.configs.datasets.piqa.piqa_ppl import piqa_datasets

reader_range = '[0:%s]' % __import__('os').environ.get('WORKBENCH_LIMIT', '')
datasets = [{**d, 'reader_cfg': {**d['reader_cfg'], 'test_range': reader_range}}
            for d in ARC_e_datasets + ARC_c_datasets + piqa_datasets]
