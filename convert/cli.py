"""``hetero-jax-convert``: HF safetensors directory or GGUF file -> hetero-jax checkpoint.

    hetero-jax-convert HF_DIR OUT_DIR [--dtype float32|bfloat16] [--force]
    hetero-jax-convert --gguf FILE OUT_DIR [--dtype float32|bfloat16] [--force]
"""

from __future__ import annotations

import argparse
import sys

from hetero_jax.errors import INTERRUPTED, HeteroJaxError, exit_console


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hetero-jax-convert",
        description="Convert a Hugging Face safetensors model directory (Llama, Qwen2, Qwen3) or a llama GGUF "
                    "file into a hetero-jax checkpoint directory.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="HF_DIR OUT_DIR, or just OUT_DIR together with --gguf FILE")
    p.add_argument("--gguf", metavar="FILE", help="import this GGUF file instead of an HF directory")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the stored parameters (default: float32)")
    p.add_argument("--force", action="store_true",
                   help="replace OUT_DIR if it holds a converted checkpoint or is empty (never other files)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the converter; returns the exit code (0 ok, 2 error)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.gguf is not None and len(args.paths) != 1:
        parser.error("with --gguf FILE give exactly one positional argument: OUT_DIR")
    if args.gguf is None and len(args.paths) != 2:
        parser.error("give HF_DIR OUT_DIR (or --gguf FILE OUT_DIR)")
    # abspath("") is the current directory: an empty input would be read from wherever the shell is.
    empty = "--gguf FILE" if args.gguf == "" else "HF_DIR" if args.gguf is None and args.paths[0] == "" else None
    if empty:
        print(f"error: {empty} is an empty string; give the path of the model to convert", file=sys.stderr)
        return 2
    try:
        if args.gguf is not None:
            from hetero_jax.io.gguf import convert_gguf

            res = convert_gguf(args.gguf, args.paths[0], dtype=args.dtype, force=args.force,
                               progress=not args.no_progress)
        else:
            from hetero_jax.io.hf import convert_hf

            res = convert_hf(args.paths[0], args.paths[1], dtype=args.dtype, force=args.force,
                             progress=not args.no_progress)
    except HeteroJaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return INTERRUPTED
    print(res.summary())
    return 0


def console_main() -> None:
    """The ``hetero-jax-convert`` console script."""
    exit_console(main())


if __name__ == "__main__":
    console_main()
