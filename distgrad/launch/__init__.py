"""Launcher and rendezvous: ``python -m distgrad.launch`` is torchrun plus a cluster secret."""
from distgrad.launch.launcher import build_parser, launch, main

__all__ = ["build_parser", "launch", "main"]
