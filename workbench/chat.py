"""A model's own chat template: tokenizer_config.json's `chat_template` (or a chat_template.jinja beside it),
rendered as transformers renders it (Jinja2 in a sandbox, trim_blocks and lstrip_blocks). A model without one
gets the server's plain 'Role: content' lines (evals/server.py)."""
from __future__ import annotations

import json
from pathlib import Path

from workbench.errors import WorkbenchError


def find_template(model_dir) -> str | None:
    d = Path(model_dir)
    if (d / "chat_template.jinja").exists():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    cfg = d / "tokenizer_config.json"
    if not cfg.exists():
        return None
    try:
        t = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
    except json.JSONDecodeError as e:
        raise WorkbenchError(f"{cfg}: invalid JSON ({e})") from None
    if isinstance(t, list):                 # named templates: the default one
        t = {x.get("name"): x.get("template") for x in t}.get("default")
    return t if isinstance(t, str) else None


def render(template: str, messages: list[dict], bos_token: str = "", eos_token: str = "") -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            bos_token=bos_token, eos_token=eos_token)
