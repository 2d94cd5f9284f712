"""`python -m edgellm ...`: the `edgellm` command, where only the package is at hand (an
environment whose scripts folder is not on PATH, or a source tree on PYTHONPATH)."""
from ._entry import main

main()
