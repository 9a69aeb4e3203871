"""Test a model: python tools/test_net.py --cfg cfgs/<dataset>/<model>.yaml [KEY VALUE ...]

Weights: TEST.WEIGHTS, or model_final.pth in CKPT (HOOKS.CHECKPOINT.OUT_DIR when set) when it is empty. Writes
CKPT/test/ (bbox.json, metrics.json with the COCO metrics and the speed summary, vis/ with --vis N).
``--eval-only-results FILE`` scores a saved results file instead, without the model.
``--backend onnxruntime --model FILE`` evaluates an ONNX export (tools/export.py) in onnxruntime
instead, through the same loop, evaluator and timers, in float32 (or int8, for an int8 export); ``--backend openvino
--model FILE`` its OpenVINO IR (tools/export.py --openvino) or the ONNX file in OpenVINO, in float32.
``--backend auto`` runs the fastest of PyTorch and this config's exports (CKPT/model.onnx, CKPT/model.int8.onnx)
on this CPU and logs which and why (pet/deploy/backend.py); the default, pytorch, reproduces the float results.
"""
import logging
import os

from pet.cli import default_argument_parser, default_setup, launch_cli
from pet.deploy.backend import resolve_backend
from pet.engine.build import build_test_hooks
from pet.engine.inference import evaluate_on_datasets, inference_precision
from pet.engine.metrics import flatten_metrics
from pet.evaluation import VisualizationHook, evaluate_results_file
from pet.evaluation.coco import write_json_atomic
from pet.predict.loading import add_backend_arguments, backend_opts, load_inference_model
from pet.utils import comm
from pet.utils.errors import ConfigError

logger = logging.getLogger("pet.tools.test_net")


def combine_speed(per_rank: list[dict]) -> dict:
    """Mean of each timer's per-image ms over ranks; images/s summed, since the ranks run in parallel."""
    timers = [k for k, v in per_rank[0].items() if isinstance(v, dict)]
    combined: dict = {}
    for name in timers:
        values = [r[name]["mean_ms"] for r in per_rank if name in r]
        combined[name] = {"mean_ms": sum(values) / len(values)}
    combined["images_per_second"] = sum(r["images_per_second"] for r in per_rank)
    return combined


def rescore(cfg, results_file: str, output_dir: str) -> None:
    """Score a saved COCO results file on the (single) test dataset; metrics go to metrics_rescored.json."""
    if len(cfg.TEST.DATASETS) != 1:
        raise ConfigError(f"--eval-only-results scores one dataset, but TEST.DATASETS has {len(cfg.TEST.DATASETS)}: "
                          f"{list(cfg.TEST.DATASETS)}. Name the one the file was made on, e.g. TEST.DATASETS "
                          f"\"('{cfg.TEST.DATASETS[0] if cfg.TEST.DATASETS else 'shapes_val'}',)\".")
    if comm.is_main_process():
        results = evaluate_results_file(cfg.TEST.DATASETS[0], results_file)
        metrics = flatten_metrics(results)
        write_json_atomic(os.path.join(output_dir, "metrics_rescored.json"),
                          {"results_file": os.path.abspath(results_file), "metrics": metrics})


def main() -> None:
    parser = default_argument_parser("Evaluate a detector with Pet")
    parser.add_argument("--eval-only-results", metavar="FILE",
                        help="score a saved COCO results file (e.g. CKPT/test/bbox.json) without running the model")
    parser.add_argument("--vis", type=int, default=0, metavar="N",
                        help="draw detections over ground truth on the first N test images into CKPT/test/vis/")
    add_backend_arguments(parser)
    args = parser.parse_args()
    choice = resolve_backend(args.cfg_file, args.opts, args.backend, args.model)
    backend, model_file = (choice.backend, choice.model) if choice else (args.backend, args.model)
    cfg = default_setup(args.cfg_file, backend_opts(args.opts, backend, choice), args.local_rank)
    if choice:
        logger.info(f"--backend auto: {choice}")
    output_dir = os.path.join(cfg.CKPT, "test")
    if args.eval_only_results:
        rescore(cfg, args.eval_only_results, output_dir)
        return
    model = load_inference_model(cfg, backend, model_file, unsafe=args.unsafe_load).model
    test_hook, hooks = build_test_hooks(cfg, args.cfg_file)
    if args.vis > 0:
        hooks.append(VisualizationHook(cfg.CKPT, num_images=args.vis))
    precision = inference_precision(cfg, model)
    metrics = evaluate_on_datasets(cfg, model, output_dir, test_hook, hooks, precision=precision)
    # Every rank timed its own shard: keep each rank's summary and their combination.
    per_rank = comm.all_gather_object(test_hook.speed_summary())
    if comm.is_main_process():
        # An export computes in float32 (an int8 export: int8) whatever TEST.AMP says.
        computed = precision.name if backend == "pytorch" else (choice.precision if choice else "export's own")
        report = {"metrics": metrics, "speed": test_hook.speed_summary(), "backend": backend, "precision": computed,
                  "precision_reason": precision.reason if backend == "pytorch" else choice.reason if choice else ""}
        if len(per_rank) > 1:
            report["speed_per_rank"] = {"ranks": per_rank, "combined": combine_speed(per_rank)}
        write_json_atomic(os.path.join(output_dir, "metrics.json"), report)


if __name__ == "__main__":
    launch_cli(main)
