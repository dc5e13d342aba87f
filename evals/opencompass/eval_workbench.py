# OpenCompass 0.5.4 config: models served by `python -m workbench serve`, multiple choice by likelihood.
# Each option is scored through the server's /v1/completions with echo (evals/opencompass/workbench_api.py) and
# OpenCompass's PPLInferencer picks the option whose whole text (context + option) has the lowest mean token
# loss, as it does for its own Hugging Face models in *_ppl configs. Run from the repository root with it on
# PYTHONPATH; commands in evals/opencompass/README.md. Settings from the environment:
#   WORKBENCH_SERVERS  comma list of NAME=URL: NAME is the served model id (`serve --served-model-name NAME`)
#                      and the model's column in OpenCompass's summary   (default demo=http://127.0.0.1:8000/v1/)
#   WORKBENCH_LIMIT    only the first N items of each dataset            (default: all)
# (No `import os`: OpenCompass dumps the config's top-level names and parses the dump again, and a module
# object does not survive that; hence __import__('os') inline.)
from opencompass.datasets import CustomDataset
from opencompass.openicl.icl_evaluator import AccEvaluator
from opencompass.openicl.icl_inferencer import PPLInferencer
from opencompass.openicl.icl_prompt_template import PromptTemplate
from opencompass.openicl.icl_retriever import ZeroRetriever

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

reader_range = '[0:%s]' % __import__('os').environ.get('WORKBENCH_LIMIT', '')

datasets = [
    dict(
        abbr=abbr,
        type=CustomDataset,
        path=path,
        reader_cfg=dict(input_columns=[column, 'A', 'B', 'C', 'D'], output_column='answer', test_range=reader_range),
        infer_cfg=dict(prompt_template=dict(type=PromptTemplate, template={k: prompt % k for k in 'ABCD'}),
                       retriever=dict(type=ZeroRetriever),
                       inferencer=dict(type=PPLInferencer)),
        eval_cfg=dict(evaluator=dict(type=AccEvaluator)),
    )
    for abbr, path, column, prompt in [
        # a TinyStories validation story's true ending among four (evals/story_tasks.py)
        ('tinystories_ending', 'data/benchmarks/tinystories_ending/ending_mcq.jsonl', 'context', '{context}{%s}'),
        # the first 500 four-choice ARC-Easy test items, lm-eval's arc prompt (evals/prepare_benchmarks.py)
        ('arc_easy_mcq', 'data/benchmarks/arc_easy/arc_easy_mcq.jsonl', 'question', 'Question: {question}\nAnswer: {%s}'),
    ]
]
