"""Puts the macOS surface (tests/macos_surface.py) on a Python process a reduced test started (its FLAG set)."""
import os

if os.environ.get("WORKBENCH_TEST_MACOS_SURFACE") == "1":
    import importlib.util
    import sys
    _spec = importlib.util.spec_from_file_location(
        "_macos_surface", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "macos_surface.py"))
    _surface = importlib.util.module_from_spec(_spec)
    sys.modules["_macos_surface"] = _surface
    _spec.loader.exec_module(_surface)
    _surface.apply()
