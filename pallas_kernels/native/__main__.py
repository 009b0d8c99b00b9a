"""``python -m pallas_kernels.native build [--force]``: builds the native CPU kernels and prints its path
(exit 1 with the reason when it cannot be built)."""

import argparse
import sys

from pallas_kernels import native


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m pallas_kernels.native")
  ap.add_argument("command", choices=["build", "path"], help="build: compile if missing; path: where it goes")
  ap.add_argument("--force", action="store_true", help="rebuild even if the library exists")
  args = ap.parse_args(argv)
  if args.command == "path":
    print(native.library_path() or "(no C++ compiler)")
    return 0
  try:
    print(native.build(force=args.force))
  except RuntimeError as e:
    print(f"native CPU kernels not built: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
