"""The evaluation layer: perplexity, teacher comparison, lm-eval adapter, an OpenAI-compatible server, reports."""
