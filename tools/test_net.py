"""Test a model: python tools/test_net.py --cfg cfgs/<dataset>/<model>.yaml [KEY VALUE ...]

Weights: TEST.WEIGHTS, or CKPT/model_final.pth when it is empty. Writes CKPT/test/
(bbox.json, metrics.json with the COCO metrics and the speed summary).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pet.data import register_custom_datasets  # noqa: E402
from pet.engine.defaults import default_argument_parser, default_setup, launch_cli  # noqa: E402
from pet.engine.inference import build_test_hooks, evaluate_on_datasets  # noqa: E402
from pet.engine.trainer import resolve_device  # noqa: E402
from pet.utils import comm  # noqa: E402
from pet.utils.registry import META_ARCH_REGISTRY  # noqa: E402
from pet.utils.weights import load_weights  # noqa: E402


def combine_speed(per_rank: list[dict]) -> dict:
    """Mean of each timer's per-image ms over ranks; images/s summed, since the ranks run in parallel."""
    timers = [k for k, v in per_rank[0].items() if isinstance(v, dict)]
    combined: dict = {}
    for name in timers:
        values = [r[name]["mean_ms"] for r in per_rank if name in r]
        combined[name] = {"mean_ms": sum(values) / len(values)}
    combined["images_per_second"] = sum(r["images_per_second"] for r in per_rank)
    return combined


def main() -> None:
    args = default_argument_parser("Evaluate a detector with Pet").parse_args()
    cfg = default_setup(args.cfg_file, args.opts, args.local_rank)
    register_custom_datasets(cfg)
    output_dir = os.path.join(cfg.CKPT, "test")
    model = META_ARCH_REGISTRY.get(cfg.MODEL.META_ARCHITECTURE)(cfg)
    load_weights(model, cfg.TEST.WEIGHTS or os.path.join(cfg.CKPT, "model_final.pth"), unsafe=args.unsafe_load)
    model.to(resolve_device(cfg.DEVICE))
    test_hook, hooks = build_test_hooks(cfg, args.cfg_file)
    metrics = evaluate_on_datasets(cfg, model, output_dir, test_hook, hooks)
    # Every rank timed its own shard: keep each rank's summary and their combination.
    per_rank = comm.all_gather_object(test_hook.speed_summary())
    if comm.is_main_process():
        report = {"metrics": metrics, "speed": test_hook.speed_summary()}
        if len(per_rank) > 1:
            report["speed_per_rank"] = {"ranks": per_rank, "combined": combine_speed(per_rank)}
        with open(os.path.join(output_dir, "metrics.json"), "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    launch_cli(main)
