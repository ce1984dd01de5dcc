"""`python -m pcldnn_gen ...` is `pcldnn-gen ...`."""
import sys

from .cli import main

sys.exit(main())
