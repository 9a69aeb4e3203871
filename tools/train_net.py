"""Train a model: python tools/train_net.py --cfg cfgs/<dataset>/<model>.yaml [KEY VALUE ...]"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pet.data import register_custom_datasets  # noqa: E402
from pet.engine.checkpoint import unwrap_model  # noqa: E402
from pet.engine.defaults import default_argument_parser, default_setup, launch_cli  # noqa: E402
from pet.engine.trainer import Trainer  # noqa: E402
from pet.utils import comm  # noqa: E402
from pet.utils.model_summary import log_model_summary  # noqa: E402


def main() -> None:
    parser = default_argument_parser("Train a detector with Pet")
    parser.add_argument("--resume", action="store_true", help="resume from CKPT/last_checkpoint")
    args = parser.parse_args()
    cfg = default_setup(args.cfg_file, args.opts, args.local_rank)
    register_custom_datasets(cfg)
    trainer = Trainer(cfg)  # a bad model, data, hook or writer setting fails here, before anything is written
    if comm.is_main_process():
        with open(os.path.join(cfg.CKPT, "config.yaml"), "w", encoding="utf-8") as f:
            f.write(cfg.dump())
        log_model_summary(unwrap_model(trainer.model), cfg)
    trainer.resume_or_load(resume=args.resume or cfg.TRAIN.AUTO_RESUME, unsafe=args.unsafe_load)
    trainer.train()


if __name__ == "__main__":
    launch_cli(main)
