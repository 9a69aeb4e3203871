"""Predict with a trained detector: python tools/predict.py --cfg FILE --input SRC [--output DIR]
[--save csv,coco,json,yolo,vis,crops] [--batch N] [--tile SIZE --tile-overlap F --tile-merge seam] [--max-det N]
[--score-thresh T] [--vis-thresh T] [--vid-stride N] [--ann COCO_JSON] [--backend {pytorch,onnxruntime,openvino,auto}]
[--model FILE]
[KEY VALUE ...]

SRC: an image, a folder (recursive), a glob, a text file of paths, or a video. Weights as in test_net
(TEST.WEIGHTS, else CKPT/model_final.pth). Output: --output, default CKPT/predict/ (the files are listed
in pet/predict/writers.py and docs/predict.md). An unreadable image is skipped and counted (DATA.ON_BAD_IMAGE
error on the command line stops instead); a missing input, an empty folder, an unreadable video or an
unwritable output folder is one line and exit status 2, before any work (an input mistake before the output
folder is made). ``--backend auto`` runs the fastest of PyTorch and this config's exports on this CPU, as
test_net does (pet/deploy/backend.py).
"""
import argparse
import datetime
import logging
import os

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from pet.cli import default_argument_parser, default_setup, launch_cli
from pet.deploy.backend import BackendChoice, resolve_backend
from pet.deploy.exported_model import ExportedModel
from pet.predict import PREDICT_DEFAULTS, PredictionWriter, Predictor, PredictStats, Source
from pet.predict.labels import model_keypoint_meta
from pet.predict.loading import add_backend_arguments, backend_opts
from pet.predict.predictor import model_score_thresh
from pet.predict.sources import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS
from pet.predict.tiling import MERGES
from pet.predict.writers import check_writable, parse_formats
from pet.utils.errors import ConfigError, DataError
from pet.utils.logger import setup_logger

logger = logging.getLogger("pet.tools.predict")


def parse_args() -> argparse.Namespace:
    parser = default_argument_parser("Predict with a trained detector")
    parser.add_argument("--input", required=True, metavar="SRC",
                        help="an image, a folder (recursive), a glob, a text file of paths, or a video")
    parser.add_argument("--output", default="", metavar="DIR", help="where to write (default: CKPT/predict)")
    parser.add_argument("--save", default="csv,coco,vis", metavar="LIST",
                        help="comma-separated outputs among csv, coco, json, yolo, vis, crops (default: csv,coco,vis)")
    parser.add_argument("--batch", type=int, default=0, metavar="N",
                        help="pictures (or tiles) per forward pass (default: TEST.IMS_PER_BATCH)")
    parser.add_argument("--tile", type=int, default=0, metavar="SIZE", help="predict by tiles of SIZE px (0: off)")
    parser.add_argument("--tile-overlap", type=float, default=0.2, metavar="F",
                        help="overlap of neighbouring tiles, a fraction of SIZE (default 0.2)")
    parser.add_argument("--tile-merge", default="seam", choices=MERGES,
                        help="how tiles' detections become one set (default seam: fragments of objects another tile "
                             "saw whole dropped, pieces of objects no tile saw whole joined; see docs/predict.md)")
    parser.add_argument("--tile-whole-image", action="store_true",
                        help="with --tile, also predict on the whole picture (at the test size) and merge it in")
    parser.add_argument("--max-det", type=int, default=None, metavar="N",
                        help="keep the N best detections per picture (default: the model's cap; 1000 with --tile)")
    parser.add_argument("--score-thresh", type=float, default=None, metavar="T",
                        help="drop detections scoring below T in every output (default: the config's test "
                             "threshold, so the defaults reproduce test_net's detections)")
    parser.add_argument("--vis-thresh", type=float, default=0.5, metavar="T",
                        help="draw only detections scoring T or more in vis (default 0.5)")
    parser.add_argument("--vid-stride", type=int, default=1, metavar="N", help="predict every N-th video frame")
    parser.add_argument("--ann", default="", metavar="COCO_JSON",
                        help="take predictions.json's image ids from this COCO file, by file name")
    add_backend_arguments(parser)
    return parser.parse_args()


def config_opts(args: argparse.Namespace, backend: str, choice: BackendChoice | None = None) -> list[str]:
    """The command line's config overrides, after predict's own defaults (skip unreadable pictures), and the
    precision of ``--backend auto``'s ``choice``."""
    return backend_opts([*PREDICT_DEFAULTS, *args.opts], backend, choice)


def check_export_threshold(cfg, cfg_file: str, model: ExportedModel, threshold: float | None) -> None:
    """Warn when ``threshold`` is below the score threshold the export ``model`` computes with: the graph drops
    lower-scoring detections itself, and only exporting again lowers it."""
    key, configured = model_score_thresh(cfg) or (None, None)
    exported = model.score_thresh
    if exported is None:  # an export older than the record: most likely the config's threshold
        exported = configured
    if threshold is None or exported is None or threshold >= exported:
        return
    recorded = (f"with score threshold {exported}" if model.score_thresh is not None
                else f"without recording its score threshold (probably the config's {exported})")
    key = key or "the model's test score threshold key"
    logger.warning(f"--score-thresh {threshold} cannot go below the export's own threshold: {model.path} was "
                   f"exported {recorded} and drops lower-scoring detections itself. For them, export again: "
                   f"python tools/export.py --cfg {cfg_file} --output FILE {key} {threshold}, then --model FILE.")


def summarize(stats: PredictStats, output: str, formats: list[str]) -> None:
    """The closing summary: pictures, detections, time per picture by stage (as test_net prints it)."""
    if stats.pictures == 0:
        examples = ", ".join(stats.skipped_examples)
        raise DataError(f"No picture could be read ({stats.skipped} skipped, e.g. {examples}).")
    summary = stats.timer.speed_summary()
    stages = " + ".join(f"{label} {summary[name]['mean_ms']:.1f}" for name, label in
                        (("data", "load"), ("infer", "infer"), ("post", "post"), ("output", "save")) if name in summary)
    timed = (f"per picture after {stats.timer.num_warmup} warm-up batches: {stages} ms" if stages
             else f"too few batches to time after {stats.timer.num_warmup} warm-up batches")
    skipped = ""
    if stats.skipped:
        skipped = f", {stats.skipped} unreadable skipped (e.g. {', '.join(stats.skipped_examples)})"
    logger.info(f"Predicted {stats.pictures} pictures{skipped}: {stats.detections} detections, {stats.seconds:.1f} s "
                f"({stats.pictures_per_second:.2f} pictures/s overall); {timed}")
    if stages:
        stats.timer.log_summary()
    logger.info(f"Wrote {', '.join(formats)} to {output}")


def check_args(args: argparse.Namespace) -> None:
    """Counts argparse cannot bound: a zero stride or a negative batch would fail deep in the run. A file where a
    config key goes is a glob the shell expanded: its files after the first (and the options after them) became
    KEY VALUE overrides, which would fail as an unknown key."""
    for key in args.opts[::2]:
        if key.lower().endswith(IMAGE_EXTENSIONS + VIDEO_EXTENSIONS) or os.path.isfile(key):
            pattern = os.path.join(os.path.dirname(args.input), "*" + os.path.splitext(args.input)[1])
            raise ConfigError(f"{key} is a file, not a config key: the shell expanded a glob given to --input into "
                              f'many arguments. Quote the glob: --input "{pattern}".')
    if args.vid_stride < 1:
        raise ConfigError(f"--vid-stride takes a whole number of 1 or more (1: every frame); got {args.vid_stride}.")
    if args.batch < 0:
        raise ConfigError(f"--batch takes 0 (TEST.IMS_PER_BATCH) or a whole number of pictures; got {args.batch}.")


def main() -> None:
    args = parse_args()
    check_args(args)
    choice = resolve_backend(args.cfg_file, args.opts, args.backend, args.model)
    backend, model_file = (choice.backend, choice.model) if choice else (args.backend, args.model)
    formats = parse_formats(args.save)
    if args.ann and not os.path.isfile(args.ann):
        raise DataError(f"--ann {args.ann} does not exist.")
    cfg = default_setup(args.cfg_file, config_opts(args, backend, choice), args.local_rank)
    output = args.output or os.path.join(cfg.CKPT, "predict")
    source = Source(args.input, exclude=output)  # before the output exists: a typo in --input leaves no folder
    check_writable(output)
    setup_logger(output)

    if choice:
        logger.info(f"--backend auto: {choice}")
    predictor = Predictor(cfg, model_file or None, backend=backend, score_thresh=args.score_thresh,
                          max_det=args.max_det, tile=args.tile, tile_overlap=args.tile_overlap,
                          tile_whole_image=args.tile_whole_image, tile_merge=args.tile_merge,
                          unsafe_load=args.unsafe_load)
    if backend != "pytorch":
        check_export_threshold(cfg, args.cfg_file, predictor.model, args.score_thresh)
    writer = PredictionWriter(output, formats, predictor.label_space, source, vis_thresh=args.vis_thresh,
                              ann=args.ann or None, vid_stride=args.vid_stride, keypoints=model_keypoint_meta(cfg))
    total = source.num_pictures(args.vid_stride)
    unit = "frame" if source.is_video.all() else "img"
    logger.info(f"Predicting on {args.input}: {total} {unit}s, writing {', '.join(formats)} to {output}")
    pictures = predictor.stream(source, args.batch or None, vid_stride=args.vid_stride,
                                with_images=writer.needs_images)
    log_every = max(1, cfg.TEST.LOG_PERIOD * (args.batch or cfg.TEST.IMS_PER_BATCH))
    with writer, logging_redirect_tqdm([logging.getLogger("pet")]), \
            tqdm(total=total, unit=unit, disable=None, dynamic_ncols=True) as bar:
        for done, detections in enumerate(pictures, 1):
            writer.write(detections)
            bar.update(1)
            if bar.disable and done % log_every == 0:  # no terminal for the bar: a line now and then instead
                rate = predictor.stats.pictures_per_second
                logger.info(f"[Predicting] {done}/{total} {unit}s, {rate:.2f}/s, eta "
                            f"{datetime.timedelta(seconds=int(max(total - done, 0) / rate)) if rate else '?'}")
    summarize(predictor.stats, output, formats)


if __name__ == "__main__":
    launch_cli(main)
