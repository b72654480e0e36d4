"""``python -m stage_worker --launch LAUNCH.json``: one serving stage, with a fast BLAS.

``stage_worker.service.process_setup`` pins the process and preloads the BLAS before
MLX loads; ``stage_worker.service.stage_process.serve`` then runs the stage.
"""

from __future__ import annotations

import sys

from stage_worker.service.process_setup import launch_parser, prepare


def main() -> int:
    argv = sys.argv[1:]
    args = launch_parser("python -m stage_worker", __doc__).parse_args(argv)
    launch = prepare("stage_worker", argv, args.launch)
    from stage_worker.model import lean_mlx_lm

    lean_mlx_lm.install()  # before anything imports mlx_lm: a stage needs its models, not its tokenizer stack
    from stage_worker.service.stage_process import serve  # MLX loads only here, after the BLAS preload

    return serve(launch)


if __name__ == "__main__":
    sys.exit(main())
