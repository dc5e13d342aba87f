"""`python -m workbench`: the program is the cli package (the apps floor); this file only hands over to it, the
one module of the core that looks up (tests/test_layering.py says why)."""
import sys

from cli import main

sys.exit(main())
