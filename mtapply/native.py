"""python -m mtapply.native: builds mtapply's host-side C++ libraries now (see mtapply._native).

They are otherwise built on first use; building them ahead of time (in a container image, say)
avoids the wait. Prints where each library is, or why it could not be built."""
from __future__ import annotations

import sys
import warnings

from . import _native


def main() -> int:
    failed = 0
    for name, needs in (("torch_describe", "torch"), ("xla_ffi", "jax"),
                        ("cpu_eight_bit", "numpy")):
        try:
            __import__(needs)
        except ImportError:
            print(f"{name}: skipped ({needs} is not installed)")
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            library = _native.library(name)
        if library is None:
            failed += 1
            print(f"{name}: not built: {caught[-1].message if caught else 'MTAPPLY_NATIVE=0'}")
        else:
            print(f"{name}: {library._name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
