"""`python -m workbench <verb> ...`: the program, assembled from the modules that declare verbs.

Each verb is declared once where it lives (workbench.commands.command); importing these modules registers
them, in this order in `--help`. The program sits above every floor it gathers verbs from, so these imports
point down. Errors a user can fix print one line on stderr and exit with code 2.
"""
from __future__ import annotations

import sys

import runtime.verbs  # noqa: F401  info, convert, probe-disk, generate
import experiments.cli  # noqa: F401  bench, ladder, trace, replay, bench-peer, routing-stats
import evals.cli  # noqa: F401  eval ppl|teacher|lm|compare|report, serve
import evals.sweep  # noqa: F401  sweep GRID.yaml on Ray
import engines.llamacpp_cli  # noqa: F401  export-gguf
from workbench.commands import main

if __name__ == "__main__":
    sys.exit(main())
