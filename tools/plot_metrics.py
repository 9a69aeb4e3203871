"""Draw training curves from one or more metrics.json files (overlaid for comparison).

    python tools/plot_metrics.py ckpts/shapes/faster_rcnn_R-10-FPN/metrics.json [other/metrics.json ...] \
        [--out curves.png] [--labels a b]

A missing or empty metrics file is a one-line error (exit status 1).
"""
import argparse
import os
import sys

from pet.engine.events import read_metrics
from pet.utils.visualization import plot_training_curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", help="metrics.json files")
    parser.add_argument("--out", default=None, help="output PNG (default: curves.png next to the first file)")
    parser.add_argument("--labels", nargs="*", default=None, help="one legend label per file")
    args = parser.parse_args()
    for path in args.metrics:
        if not os.path.isfile(path):
            sys.exit(f"Error: metrics file not found: {path}")
    if args.labels and len(args.labels) != len(args.metrics):
        sys.exit("Error: give one --labels entry per metrics file")
    runs = [read_metrics(f) for f in args.metrics]
    for path, records in zip(args.metrics, runs):
        if not records:
            sys.exit(f"Error: no metrics records (JSON lines) in {path}")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.metrics[0])), "curves.png")
    labels = args.labels or [os.path.basename(os.path.dirname(os.path.abspath(f))) for f in args.metrics]
    print(plot_training_curves(runs, out, labels))


if __name__ == "__main__":
    main()
