"""Train a net on the digits data (scikit-learn's bundled 8x8 handwritten digits, upsampled to
16x16), on a synthetic set, on an image folder or on .npy files, on this machine (or under
mpiexec, over its ranks). `make demo` runs it with the defaults; `pcldnn-gen train NET.json`
is the same command with the net as an argument (`--help` lists the options).

The last line reports the test accuracy and the training throughput in images/s.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pcldnn_gen.train_cli import add_arguments, run

NET = Path(__file__).parent / "nets" / "digits.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    add_arguments(ap, net_default=str(NET), data_default="digits")
    return run(ap.parse_args(argv), prog="train.py")


if __name__ == "__main__":
    sys.exit(main())
