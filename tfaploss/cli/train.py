"""``tfaploss train``: an embedding model trained from a run config
(:func:`tfaploss.run.trainer.train`)."""

from __future__ import annotations

import textwrap

from tfaploss.cli.arguments import add_command, add_config_arguments
from tfaploss.cli.config import load_run_config
from tfaploss.log import is_terminal


def register(sub) -> None:
    add_command(
        sub, "train", cmd_train, _arguments,
        help="train an embedding model from a YAML recipe",
        description=textwrap.dedent("""\
            Train an embedding model from a run config: your YAML file, or a shipped
            recipe as --config recipe:NAME (`tfaploss recipes` lists them).

            The config names the TFRecords (data.train, data.test; write them with a
            pipelines job), the model, the loss, the optimizer and how long to train.
            A batch larger than training.chunk_size is trained with multi-stage
            backpropagation (tfaploss.training.MultiStageModel): same gradient as
            one pass over the whole batch, the memory of one chunk.

            Everything goes to the run directory (run_dir, or --run-dir):
              config.yaml    the validated config        logs/        TensorBoard
              epochs.jsonl   per-epoch loss/lr/metrics   model.keras  the model
              backup/        checkpoint of the last finished epoch
              summary.json   epochs, steps, timings, final metrics
            A killed run resumes from its last finished epoch when you run the same
            command again: every file is written to a temporary name and renamed into
            place, so a kill at any moment loses at most the epoch in progress; the
            same command on a finished run does nothing.
            The run directory is checked first: a damaged one (a file cut short, not
            UTF-8, not YAML or JSON, absurd numbers: what no kill leaves) stops with
            exit status 2 and a message naming the file; nothing is changed, and the
            run never starts over by itself. --restart starts over at epoch 1, moving
            the previous run's files aside into RUN_DIR/damaged-<time>/ (or
            previous-<time>/), never deleting them. One run per run directory: a
            second run started on it exits with status 2, naming the first (its PID,
            since when, its command).
            Optional parts the config names are checked first: a missing one
            (evaluation.backend: scann without ScaNN) stops with exit status 2 and
            the pip install line, before anything is trained. The default
            evaluation.backend, auto, needs none: exact search, or with
            evaluation.target_recall the best searcher installed (ScaNN, else exact).
            Training stops (exit status 3) at the first non-finite loss or weight,
            and nothing non-finite is saved. With stdout not a terminal (a log file),
            progress is one line per epoch."""),
        epilog=textwrap.dedent("""\
            examples:
              tfaploss train --config recipe:demo_digits --run-dir demo_output/run2
                  (after `tfaploss demo`, which wrote demo_output/)
              tfaploss train --config recipe:smoothap_sop_resnet50 \\
                  --set data.train=data/sop/train --set data.test=data/sop/test \\
                  --set model.weights=path/to/resnet50_notop.h5
              tensorboard --logdir runs/"""))


def _arguments(p) -> None:
    add_config_arguments(p)
    p.add_argument("--run-dir", metavar="DIR",
                   help="where checkpoints, logs and the model go (default: the config's "
                        "run_dir)")
    p.add_argument("--restart", action="store_true",
                   help="start over at epoch 1 whatever the run directory holds (a "
                        "damaged, unfinished or finished run): its files are moved aside "
                        "into RUN_DIR/damaged-<time>/ or previous-<time>/, not deleted")
    p.add_argument("--verify-data", choices=("sizes", "full", "off"), default="sizes",
                   help="check the data against its manifest.json before the first step: "
                        "sizes (default, no read), full (also every file's checksum: one "
                        "read of the split) or off")
    p.add_argument("--skip-damaged-shards", action="store_true",
                   help="leave out damaged shards of the training split and go on (found "
                        "by a full check at start-up; counted in summary.json) instead of "
                        "stopping")
    ranks = p.add_argument_group(
        "several processes", "PyTorch: launch with torchrun (torchrun --nproc_per_node N "
        "--no-python tfaploss train ...), which these flags are not for. JAX: one "
        "tfaploss train per process, all with the same --coordinator; rank 0 writes the "
        "run directory (docs/scale_out.md)")
    ranks.add_argument("--coordinator", metavar="HOST:PORT",
                       help="JAX: address of process 0's coordinator, or 'auto' to take "
                            "the processes from the launcher's environment (SLURM, Open "
                            "MPI, Kubernetes); default $JAX_COORDINATOR_ADDRESS")
    ranks.add_argument("--num-processes", type=int, metavar="N",
                       help="JAX: processes in the run (default $JAX_NUM_PROCESSES)")
    ranks.add_argument("--process-id", type=int, metavar="I",
                       help="JAX: this process's rank, 0..N-1 (default $JAX_PROCESS_ID)")


def cmd_train(args) -> int:
    cfg = load_run_config(args)
    from tfaploss.run.needs import check_config_extras
    from tfaploss.run.trainer import train

    check_config_extras(cfg)  # train() checks too; here before its run directory
    from tfaploss.run import processes

    processes.start(cfg.training.distribute, coordinator=args.coordinator,
                    num_processes=args.num_processes, process_id=args.process_id)
    train(cfg, run_dir=args.run_dir, verbose=2 if args.quiet or not is_terminal() else 1,
          restart=args.restart, verify_data=args.verify_data,
          skip_damaged=args.skip_damaged_shards)
    return 0
