# OpenCompass 0.5.4 config: the model served by `python -m workbench serve`, through the OpenAISDK model type,
# on a local multiple-choice jsonl (OpenCompass "custom dataset": rows {"question", "A", "B", "C", "D", "answer"}).
# Run from the repository root (relative paths); see evals/opencompass/README.md for the exact commands.
#   WORKBENCH_URL        the server's /v1/ base   (default http://127.0.0.1:8000/v1/)
#   WORKBENCH_MODEL_ID   the served model id       (default demo: `serve --model demo`)
#   WORKBENCH_TOKENIZER  a local Hugging Face tokenizer directory (default data/models/demo-moe); without one
#                        OpenAISDK tries to download a tiktoken encoding and fails offline
#   WORKBENCH_MCQ        the jsonl                 (default data/benchmarks/arc_easy/arc_easy_mcq.jsonl)
# (No `import os`: OpenCompass dumps the config's top-level names and parses the dump again, and a module
# object does not survive that; hence __import__('os') inline.)
from opencompass.models import OpenAISDK

api_meta_template = dict(round=[
    dict(role='HUMAN', api_role='HUMAN'),
    dict(role='BOT', api_role='BOT', generate=True),
])

models = [
    dict(
        type=OpenAISDK,
        abbr='workbench-' + __import__('os').environ.get('WORKBENCH_MODEL_ID', 'demo'),
        path=__import__('os').environ.get('WORKBENCH_MODEL_ID', 'demo'),
        key='EMPTY',
        openai_api_base=__import__('os').environ.get('WORKBENCH_URL', 'http://127.0.0.1:8000/v1/'),
        tokenizer_path=__import__('os').environ.get('WORKBENCH_TOKENIZER', 'data/models/demo-moe'),
        meta_template=api_meta_template,
        query_per_second=4,
        batch_size=4,
        retry=2,
        max_out_len=8,
        max_seq_len=1024,
        temperature=0.0,
        # OpenAISDK retries, then fails the task, on an empty reply: ask the server not to end before a token
        extra_body=dict(min_tokens=1),
    ),
]

datasets = [
    dict(
        path=__import__('os').environ.get('WORKBENCH_MCQ', 'data/benchmarks/arc_easy/arc_easy_mcq.jsonl'),
        abbr='arc_easy_mcq',
        data_type='mcq',
        infer_method='gen',
    ),
]
