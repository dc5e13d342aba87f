"""Imported at interpreter start-up by workbench_lm_eval.pth (see evals.lm_eval_adapter.install_plugin).

Cheap: it imports nothing. When lm-eval loads its model table (`lm_eval.models`), it adds a lazy
entry "workbench" -> evals.lm_eval_adapter:WorkbenchLM, so `lm_eval --model workbench` works.
"""
import sys

_TARGET = "evals.lm_eval_adapter:WorkbenchLM"


def _register():
    try:
        from lm_eval.api.registry import model_registry
        if "workbench" not in model_registry:
            model_registry.register("workbench", target=_TARGET)
    except Exception:   # never break lm_eval itself
        pass


class _Finder:
    """A meta-path finder that only wraps the loader of lm_eval.models."""

    def find_spec(self, name, path, target=None):
        if name != "lm_eval.models":
            return None
        from importlib.machinery import PathFinder
        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            _register()
        spec.loader.exec_module = exec_and_register
        return spec


if "lm_eval.models" not in sys.modules and not any(type(f).__name__ == "_Finder" for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
