"""Train a model: python tools/train_net.py --cfg cfgs/<dataset>/<model>.yaml [KEY VALUE ...]"""

from pet.cli import build_trainer, default_argument_parser, default_setup, launch_cli


def main() -> None:
    parser = default_argument_parser("Train a detector with Pet")
    parser.add_argument("--resume", action="store_true", help="resume from CKPT/last_checkpoint")
    parser.add_argument("--resume-weights-only", action="store_true",
                        help="resume all but the optimizer's state (needed after changing SOLVER.OPTIMIZER)")
    args = parser.parse_args()
    cfg = default_setup(args.cfg_file, args.opts, args.local_rank)
    build_trainer(cfg, resume=args.resume, unsafe=args.unsafe_load, weights_only=args.resume_weights_only).train()


if __name__ == "__main__":
    launch_cli(main)
