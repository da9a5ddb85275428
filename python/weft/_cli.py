"""The ``weft`` command of a wheel (``weft run``, ``weft info``,
``weft bench``): the Rust command-line tool travels inside the package
(``weft/bin/weft``, put there by ``scripts/build-wheel.sh``) and this entry
point replaces the Python process with it."""

from __future__ import annotations

import os
import sys


def main() -> None:
    """Run the bundled ``weft`` command with this process's arguments."""
    exe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "weft")
    if not os.access(exe, os.X_OK):
        sys.exit(
            "weft: this install has no weft command (it comes with wheels built by scripts/build-wheel.sh); "
            "from a source checkout run it with `cargo run --release -p weft-cli --`"
        )
    os.execv(exe, [exe, *sys.argv[1:]])


if __name__ == "__main__":
    main()
