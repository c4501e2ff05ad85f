"""`python3 -m carpool.kernels`: build the kernels for this CPU now (CI does this before the
tests, so no test is charged for the build) and say where they are, or exit 1."""

import sys

from carpool.kernels import load

module = load()
if module is None:
    sys.exit("carpool kernels: the build failed (the warning above says why)")
print(f"carpool kernels: {module.__file__}")
