"""Choose the EMA length after training: synthesize post-hoc EMAs from a run's snapshots and write them.

    python -m training_utils.posthoc_ema --output_dir out --sigma_rel 0.06 0.08 [--step 1000]

writes ``out/posthoc_ema/sigma_rel-<value>/`` (``sigma_rel-<value>-step-<S>/`` with ``--step``) in the
run's own output format (a LoRA ``pipe.load_lora_weights`` loads, an adapter in peft's format, or a model folder),
and prints the least-squares coefficients and the reconstruction error.
"""

from . import read_snapshots
from ..args import TrainingArgumentParser
from ..errors import exit_on_usage_error, require
from ..names import SNAPSHOT_DIR
from .profiles import MAX_SIGMA_REL
from .synthesis import output_folder, read_export, synthesize, write_synthesis


def main(argv=None):
    parser = TrainingArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True, help="the training run's output_dir (snapshots in posthoc_ema/)")
    parser.add_argument("--sigma_rel", type=float, nargs="+", required=True,
                        help="EMA lengths to synthesize, each in (0, 1/sqrt(12))")
    parser.add_argument("--step", type=int, default=None,
                        help="the optimizer step to synthesize at (default: the last snapshot's); "
                             "later snapshots are ignored")
    args = parser.parse_args(argv)
    with exit_on_usage_error():
        for sigma_rel in args.sigma_rel:
            require(0 < sigma_rel < MAX_SIGMA_REL, "--sigma_rel", sigma_rel, f"a value in (0, {MAX_SIGMA_REL:.4f})")
        snapshots = read_snapshots(args.output_dir)
        require(snapshots, "--output_dir", args.output_dir,
                f"a training output folder with {SNAPSHOT_DIR}/snapshot-*.safetensors")
        require(args.step is None or snapshots[0].step <= args.step, "--step", args.step,
                f"a step at or after the first snapshot's ({snapshots[0].step})")
        export = read_export(args.output_dir)
        for result in synthesize(args.output_dir, args.sigma_rel, args.step):
            path = write_synthesis(result, export, output_folder(args.output_dir, result.sigma_rel, args.step))
            print(f"sigma_rel {result.sigma_rel:g} (gamma {result.gamma:.4f}) at step {result.step}: "
                  f"relative profile error {result.relative_error:.3e}")
            for snapshot, coefficient in zip(result.snapshots, result.coefficients):
                print(f"  {coefficient:+.6f}  {snapshot.path.name}  (step {snapshot.step}, "
                      f"sigma_rel {snapshot.sigma_rel:g})")
            print(f"  wrote {path}")


if __name__ == "__main__":
    main()
