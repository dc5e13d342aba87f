# OpenCompass 0.5.4 config: its own ARC-Easy, ARC-Challenge and PIQA configs (the *_ppl ones: multiple choice by
# likelihood) on the models `python -m workbench serve` exposes. The data comes from $COMPASS_DATA_CACHE, made from
# the local copies by `python -m evals.opencompass.local_data` (nothing is downloaded). Settings from the
# environment, as in eval_workbench.py: WORKBENCH_SERVERS (NAME=URL, comma list), WORKBENCH_LIMIT (first N items).
from mmengine.config import read_base

with read_base():
    from opencompass.configs.datasets.ARC_c.ARC_c_ppl import ARC_c_datasets
    from opencompass.configs.datasets.ARC_e.ARC_e_ppl import ARC_e_datasets
    from opencompass.configs.datasets.piqa.piqa_ppl import piqa_datasets

models = [
    dict(
        type='evals.opencompass.workbench_api.WorkbenchCompletions',
        abbr=server.split('=', 1)[0],
        path=server.split('=', 1)[0],
        url=server.split('=', 1)[1],
        max_seq_len=1024,
        batch_size=16,
        max_out_len=16,
    )
    for server in __import__('os').environ.get('WORKBENCH_SERVERS', 'demo=http://127.0.0.1:8000/v1/').split(',')
]

datasets = [
    {**d, 'reader_cfg': {**d['reader_cfg'], 'test_range': '[0:%s]' % __import__('os').environ.get('WORKBENCH_LIMIT', '')}}
    for d in ARC_e_datasets + ARC_c_datasets + piqa_datasets
]
