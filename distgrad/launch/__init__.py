"""Local launcher: ``python -m distgrad.launch --nproc-per-node N script.py [args]``."""
from distgrad.launch.launcher import build_parser, find_free_port, launch, main

__all__ = ["build_parser", "find_free_port", "launch", "main"]
